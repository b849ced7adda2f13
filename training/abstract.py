"""The product's train step compiled for devices this host may not have.

With abstract devices (planning.targets: `v5p:2x2x2`, `h100:8`, ...) the mesh is real to the
compiler but nothing can run on it, so the model and optimizer are shapes only (nnx.eval_shape)
and the step is lowered and compiled, never called: its memory figures and HLO (which kernels,
which collectives) are the target's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from training import optim
from training.loop import Trainer


def abstract_trainer(cfg, strategy, mesh, *, packed: bool = True) -> Trainer:
    """A Trainer over shape-only model and AdamW state, laid out by `strategy` on `mesh`."""
    from zoo.build import fit_vocab, model_class

    cfg = fit_vocab(cfg, strategy, mesh)
    tx, _ = optim.make_optimizer(learning_rate=1e-3, warmup_steps=1, total_steps=10)

    def build():
        model = model_class(cfg)(cfg, strategy.lm_sharding(), rngs=nnx.Rngs(0))
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    with jax.set_mesh(mesh):
        model, optimizer = nnx.eval_shape(build)
    return Trainer(model, optimizer, batch_spec=strategy.batch_spec(), packed=packed)


def abstract_batch(strategy, mesh, batch_size: int, seq_len: int) -> dict:
    """tokens / segment_ids / positions as int32 [B, T] shapes in the strategy's layout."""
    sharding = NamedSharding(mesh, strategy.batch_spec())
    shape = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32, sharding=sharding)
    return {"tokens": shape, "segment_ids": shape, "positions": shape}


def compile_train_step(cfg, strategy, mesh, *, batch_size: int, seq_len: int, packed=True):
    """The compiled train step (jax `Compiled`: .memory_analysis(), .as_text())."""
    trainer = abstract_trainer(cfg, strategy, mesh, packed=packed)
    batch = abstract_batch(strategy, mesh, batch_size, seq_len)
    with jax.set_mesh(mesh):
        return trainer.lower(batch).compile()


def compile_eval_step(cfg, strategy, mesh, *, batch_size: int, seq_len: int, packed=True):
    """The compiled evaluation step (summed loss of a batch, no gradients)."""
    trainer = abstract_trainer(cfg, strategy, mesh, packed=packed)
    batch = abstract_batch(strategy, mesh, batch_size, seq_len)
    with jax.set_mesh(mesh):
        return trainer.lower(batch, train=False).compile()
