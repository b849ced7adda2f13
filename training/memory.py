"""What one train step needs per device, from XLA's compiled program, without running it.

The step compiled here is the real one (`training.loop.Trainer`: loss, gradients, AdamW
update, donated state) on abstract arrays (shapes, dtypes, layouts; no values), so it works
for models far too large for this machine and for devices it does not have (a TPU topology).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding


def memory_bytes(compiled) -> dict[str, int]:
    """Per-device argument / temp / peak bytes of a compiled step ({} if XLA gives none).

    Peak is XLA's own figure on TPU/GPU. The CPU backend's figure leaves out the temporary
    buffers (it reports about the argument size), so there the peak is the upper bound
    argument + output + temp, less the outputs that reuse (donated) argument buffers.
    """
    memory = compiled.memory_analysis()
    if memory is None:
        return {}
    argument, temp = int(memory.argument_size_in_bytes), int(memory.temp_size_in_bytes)
    peak = int(getattr(memory, "peak_memory_in_bytes", 0) or 0)
    if _platform(compiled) == "cpu" or not peak:
        peak = argument + int(memory.output_size_in_bytes) + temp - int(memory.alias_size_in_bytes)
    return {"argument_bytes": argument, "temp_bytes": temp, "peak_bytes": peak}


def _platform(compiled) -> str | None:
    for sharding in jax.tree.leaves(compiled.input_shardings):
        mesh = getattr(sharding, "mesh", None)
        if mesh is not None and getattr(mesh, "devices", None) is not None:
            return mesh.devices.flat[0].platform
        devices = getattr(sharding, "device_set", None)
        if devices:
            return next(iter(devices)).platform
    return None


def abstract_batch(batch_size: int, seq_len: int, mesh, spec) -> dict[str, jax.ShapeDtypeStruct]:
    arr = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32, sharding=NamedSharding(mesh, spec))
    return {"tokens": arr, "segment_ids": arr, "positions": arr}


def compile_train_step(
    model_cfg,
    strategy,
    mesh,
    *,
    batch_size: int,
    seq_len: int,
    loss_chunk_size: int,
    micro_batches: int = 1,
):
    """The compiled train step of `model_cfg` under `strategy` on `mesh` (abstract arrays)."""
    from training.loop import Trainer
    from training.optim import make_optimizer
    from zoo.build import check_model_fits, fit_vocab, model_class

    model_cfg = fit_vocab(model_cfg, strategy, mesh)
    check_model_fits(model_cfg, strategy, mesh)
    cls, sharding = model_class(model_cfg), strategy.lm_sharding()
    with jax.set_mesh(mesh):
        model = nnx.eval_shape(lambda: cls(model_cfg, sharding, rngs=nnx.Rngs(0)))
        tx, _ = make_optimizer(learning_rate=1e-3, warmup_steps=0, total_steps=10)
        optimizer = nnx.eval_shape(lambda: nnx.Optimizer(model, tx, wrt=nnx.Param))
        trainer = Trainer(
            model,
            optimizer,
            micro_batches=micro_batches,
            batch_spec=strategy.batch_spec(),
            loss_chunk_size=loss_chunk_size,
        )
        batch = abstract_batch(batch_size, seq_len, mesh, strategy.batch_spec())
        return trainer._train_jit.lower(trainer.state, batch).compile()


def train_step_memory(model_cfg, strategy, mesh, **kwargs) -> dict[str, int]:
    """`memory_bytes` of `compile_train_step(model_cfg, strategy, mesh, **kwargs)`."""
    return memory_bytes(compile_train_step(model_cfg, strategy, mesh, **kwargs))
