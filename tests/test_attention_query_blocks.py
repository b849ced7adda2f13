"""The XLA attention path's query blocks (causal self-attention of T >= 256 skips the key
blocks above the diagonal, and before a window) against the naive reference.

The reference (tests/attention_reference.py) masks by explicit loops and computes every
(query, key) pair, so a block that drops a visible key, or keeps an invisible one, shows.
Padding queries (segment 0) are left out of the comparison: what they see is not specified
(zoo/layers/attention_mask.py) and the loss ignores them; they must stay finite.

Tolerance: float32, atol 2e-5 -- sums of up to 512 terms in another order than the
reference (grouped heads, finite masking value).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_reference import packed_rows, reference_attention, reference_mask
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from zoo.layers.attention import Segments, xla
from zoo.layers.attention import dispatch as attention_ops

ATOL = 2e-5
T, N, K, D = 512, 4, 2, 8
SCALE = D**-0.5
# Row 0: documents crossing every block border, then padding; row 1: one long document.
DOCS = [[100, 200, 150], [T]]


def _inputs(seed=0):
    seg, pos = packed_rows(DOCS, T)
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    B = len(DOCS)
    q = jax.random.normal(kq, (B, T, N, D))
    k = jax.random.normal(kk, (B, T, K, D))
    v = jax.random.normal(kv, (B, T, K, D))
    return seg, pos, q, k, v


def _attend(q, k, v, seg, pos, window, out_sharding=None):
    # Self-attention: one ids array for queries and keys, as the model passes it.
    segments = Segments.self_attention(seg, pos)
    return attention_ops.attention(
        q,
        k,
        v,
        segments,
        scale=SCALE,
        causal=True,
        sliding_window=window,
        out_sharding=out_sharding,
        implementation="xla",
    )


@pytest.mark.parametrize("window", [None, 150])
def test_blocks_are_the_ones_needed(window):
    blocks = xla.causal_blocks(T, T, True, window, True, None)
    assert blocks == [
        (t0, t0 + 128, 0 if window is None else max(0, (t0 - 149) // 128 * 128), t0 + 128)
        for t0 in range(0, T, 128)
    ]
    # Not for cross-attention (a KV cache), non-causal rows, or rows too short to split.
    assert xla.causal_blocks(T, T, True, window, False, None) is None
    assert xla.causal_blocks(T, T, False, window, True, None) is None
    assert xla.causal_blocks(64, 64, True, window, True, None) is None


@pytest.mark.parametrize("window", [None, 150])
def test_query_blocks_equal_reference_forward_and_gradients(window):
    seg, pos, q, k, v = _inputs()
    mask = reference_mask(seg, seg, pos, pos, True, window)
    real = jnp.asarray(seg != 0)[:, :, None, None]
    proj = jax.random.normal(jax.random.key(7), q.shape) * real  # padding queries count 0

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v) * proj)

    def ours(q, k, v):
        return _attend(q, k, v, jnp.asarray(seg), jnp.asarray(pos), window)

    def ref(q, k, v):
        return reference_attention(q, k, v, mask, SCALE)

    out = jax.jit(ours)(q, k, v)
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_allclose(out * real, ref(q, k, v) * real, atol=ATOL, rtol=0)
    grads = jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2)))(q, k, v)
    ref_grads = jax.grad(loss(ref), argnums=(0, 1, 2))(q, k, v)
    for name, g, rg in zip("qkv", grads, ref_grads, strict=True):
        np.testing.assert_allclose(g, rg, atol=ATOL, rtol=0, err_msg=f"d{name}")


def test_query_blocks_under_a_head_split_mesh():
    """Heads over `model`, batch over `data`: the blocks keep the layout and the values."""
    mesh = jax.make_mesh(
        (2, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2, devices=jax.devices()[:4]
    )
    seg, pos, q, k, v = _inputs(seed=1)
    mask = reference_mask(seg, seg, pos, pos, True, None)
    real = (seg != 0)[:, :, None, None]
    spec = P("data", None, "model", None)
    with jax.set_mesh(mesh):
        qs, ks, vs = (jax.sharding.reshard(x, spec) for x in (q, k, v))
        seg_s, pos_s = (jax.sharding.reshard(jnp.asarray(x), P("data", None)) for x in (seg, pos))
        out = jax.jit(lambda q, k, v: _attend(q, k, v, seg_s, pos_s, None, spec))(qs, ks, vs)
        assert jax.typeof(out).sharding.spec == spec
    want = reference_attention(q, k, v, mask, SCALE)
    np.testing.assert_allclose(np.asarray(out) * real, np.asarray(want) * real, atol=ATOL, rtol=0)
