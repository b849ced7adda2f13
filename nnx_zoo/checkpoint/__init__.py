"""What a run keeps on disk: Orbax checkpoints with checksums (`manager`, `integrity`), the
resume rules (`resume`), atomic file writes (`files`) and the workdir lock (`workdir`).

Imports no model family and no training step: models come in as NNX modules.
"""
