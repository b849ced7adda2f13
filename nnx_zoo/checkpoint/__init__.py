"""What a run keeps on disk: Orbax checkpoints saved with checksums (`manager`: the
`Checkpointer`, which alone decides which steps are due), the step directories and their
checks (`steps`, `integrity`), reading a checkpoint back onto any layout (`restore`), the
workdir lock (`workdir`) and full-disk and vanished-directory saves (`write_errors`).

Imports no model family, no training code and no run config: models come in as NNX modules.
"""
