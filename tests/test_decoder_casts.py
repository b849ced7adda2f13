"""The layer scan takes its matmul weights already in the compute dtype (cast once before the
loop, zoo/layers/decoder.py): the same loss and gradients as casting inside every layer."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnx_zoo.training.loop import _loss_and_grad
from shardings import get_strategy
from zoo import create_model, get_config
from zoo.layers.decoder import DecoderLM

CFG = get_config("tiny", dtype="bfloat16", remat="full", num_layers=3)


def _loss_and_grads(monkeypatch, cast_before_loop: bool):
    if not cast_before_loop:
        monkeypatch.setattr(
            DecoderLM,
            "_compute_dtype_blocks",
            lambda self, blocks=None: self.blocks if blocks is None else blocks,
        )
    strategy = get_strategy("fsdp")
    mesh = strategy.make_mesh()
    with jax.set_mesh(mesh):
        model = create_model(CFG, strategy, rngs=nnx.Rngs(0))
        tokens = jax.random.randint(jax.random.key(1), (8, 32), 1, CFG.vocab_size)
        batch = {
            "tokens": tokens,
            "segment_ids": jnp.ones_like(tokens),
            "positions": jnp.broadcast_to(jnp.arange(32), tokens.shape),
        }
        (loss, _), grads = nnx.jit(_loss_and_grad)(model, batch)
    monkeypatch.undo()
    return float(loss), jax.tree.map(np.asarray, nnx.to_pure_dict(grads))


def test_cast_before_the_loop_gives_the_same_loss_and_gradients(monkeypatch):
    loss, grads = _loss_and_grads(monkeypatch, cast_before_loop=True)
    ref_loss, ref_grads = _loss_and_grads(monkeypatch, cast_before_loop=False)
    # Same bf16 values enter every matmul; only XLA's fusion of the casts differs, so the
    # float32 loss and gradients agree to float32 rounding of bf16 products (1e-6 relative).
    assert loss == np.float32(ref_loss) or abs(loss - ref_loss) < 1e-6 * abs(ref_loss)
    flat = jax.tree.leaves(grads)
    ref_flat = jax.tree.leaves(ref_grads)
    assert len(flat) == len(ref_flat)
    for g, r in zip(flat, ref_flat, strict=True):
        assert g.dtype == r.dtype == np.float32  # gradients reach the f32 parameters as f32
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-7)
