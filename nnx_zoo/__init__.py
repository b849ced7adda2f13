"""nnx-zoo's run machinery, in one namespace: what a run needs around the models (`zoo`) and
their layouts (`shardings`) -- data, the training step and loop, checkpoints, process start-up,
the assembly of a run (`launch`), evaluation, planning, export.

Nothing is imported here, so `from nnx_zoo.launch import cli` stays light (entry points import
it before jax)."""
