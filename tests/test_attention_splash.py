"""The splash backend (the Pallas TPU kernel, run in interpret mode on CPU) equals the naive
reference and the xla path, forward and q/k/v gradients: MHA, GQA and MQA, causal, packed
rows of 3 documents and padding, sliding windows, float32 and bfloat16.

Rows are T = 128 long: the kernel tiles keys in multiples of 128 (TPU lanes), in interpret
mode too. Outputs are compared at real (non-padding) queries only: what a padding query sees
is backend-defined (splash masks causally by index, xla by position, where padding sits at
position 0); the loss ignores it. Gradients come from a loss that weights padding queries by
zero, as the training loss does, so they are compared everywhere (a padding key is visible
only to padding queries and gets no gradient in either).

Tolerances (absolute; outputs and gradients are O(1)):
- float32: 2e-5 forward, 5e-5 gradients. Flash attention sums over 128-key blocks with an
  online softmax (running max and rescaling) where the reference does one softmax; the
  rounding differs by a few float32 ulps per term over sums of <= 128 terms (measured: 3e-7
  forward, 7e-6 gradients).
- bfloat16 inputs, against the float32 reference on the same rounded inputs: 3e-2 forward
  and 6e-2 gradients, and against xla in bfloat16 the same. Splash scales q in bfloat16
  before the kernel (one more rounding of q, relative 2**-8) and both round probabilities
  to bfloat16 before the second matmul; a few bf16 ulps of O(1) values. Gradients go through
  two such matmuls each.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_reference import packed_rows, reference_attention, reference_mask

from nnx_zoo.errors import UsageError
from zoo.layers.attention import Segments, attention, choices
from zoo.layers.attention import dispatch as attention_ops

T = 128
D = 16
SCALE = 0.3  # not D**-0.5: a family's own scale must reach the kernel (which has none)
HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}
# Three documents then padding in each row.
DOCS = [[40, 50, 20], [100, 10, 6]]
WINDOWS = {"causal": None, "window": 7}
TOL = {"float32": (2e-5, 5e-5), "bfloat16": (3e-2, 6e-2)}  # (forward, gradients)
# Each head layout, each mask and each dtype at least once (interpret mode compiles slowly).
COMBOS = [
    ("gqa", "float32", "causal"),
    ("mha", "float32", "window"),
    ("mqa", "float32", "causal"),
    ("gqa", "bfloat16", "window"),
]


def _inputs(N, K, dtype, seed=0):
    seg, pos = packed_rows(DOCS, T)
    B = len(DOCS)
    kq, kk, kv, kp = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(kq, (B, T, N, D), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (B, T, K, D), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (B, T, K, D), jnp.float32).astype(dtype)
    # A random projection of the output (a plain sum would hide errors that cancel), zero
    # at padding queries as in the training loss.
    real = (seg != 0)[:, :, None, None]
    proj = jax.random.normal(kp, (B, T, N, D), jnp.float32) * real
    return q, k, v, seg, pos, proj


def _attend(implementation, seg, pos, window):
    segments = Segments.self_attention(jnp.asarray(seg), jnp.asarray(pos))

    def run(q, k, v):
        return attention(
            q,
            k,
            v,
            segments,
            scale=SCALE,
            out_sharding=None,
            sliding_window=window,
            implementation=implementation,
            interpret=True,
        )

    return run


def _fwd_and_grads(fn, proj):
    def loss(q, k, v):
        return jnp.sum(fn(q, k, v).astype(jnp.float32) * proj)

    return jax.jit(lambda q, k, v: (fn(q, k, v), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)))


@pytest.mark.parametrize(("heads", "dtype", "case"), COMBOS)
def test_splash_equals_reference_and_xla(heads, dtype, case):
    N, K = HEADS[heads]
    window = WINDOWS[case]
    q, k, v, seg, pos, proj = _inputs(N, K, jnp.dtype(dtype))
    mask = reference_mask(seg, seg, pos, pos, True, window)
    assert not mask.all() and mask.any(axis=-1).all()
    real = np.asarray(seg != 0)[:, :, None, None]

    out, grads = _fwd_and_grads(_attend("splash", seg, pos, window), proj)(q, k, v)
    xla_out, xla_grads = _fwd_and_grads(_attend("xla", seg, pos, window), proj)(q, k, v)
    ref_fn = lambda q, k, v: reference_attention(q, k, v, mask, SCALE)  # noqa: E731
    ref_out, ref_grads = _fwd_and_grads(ref_fn, proj)(*(x.astype(jnp.float32) for x in (q, k, v)))

    assert out.shape == q.shape and out.dtype == q.dtype
    atol, gtol = TOL[dtype]
    out32 = np.where(real, np.asarray(out, np.float32), 0)
    for name, other in (("reference", ref_out), ("xla", xla_out)):
        other = np.where(real, np.asarray(other, np.float32), 0)
        np.testing.assert_allclose(out32, other, atol=atol, rtol=0, err_msg=name)
    for n, g, xg, rg in zip("qkv", grads, xla_grads, ref_grads, strict=True):
        assert g.dtype == q.dtype and float(jnp.abs(rg).max()) > 1e-2, f"weak d{n}"
        g = np.asarray(g, np.float32)
        np.testing.assert_allclose(g, rg, atol=gtol, rtol=0, err_msg=f"d{n} vs reference")
        np.testing.assert_allclose(g, np.asarray(xg, np.float32), atol=gtol, err_msg=f"d{n} xla")


def test_packed_rows_keep_documents_apart():
    """The same document alone in its row gives the same output as inside the packed row
    (so documents really are kept apart, not just close to a reference)."""
    N, K = HEADS["gqa"]
    q, k, v, seg, pos, _ = _inputs(N, K, jnp.float32)
    packed = jax.jit(_attend("splash", seg, pos, None))(q, k, v)
    start, n = 40, 50  # row 0's second document
    alone = [np.zeros_like(x[:1]) for x in (q, k, v)]
    for a, x in zip(alone, (q, k, v), strict=True):
        a[0, :n] = x[0, start : start + n]
    seg1 = np.zeros((1, T), np.int32)
    seg1[0, :n] = 1
    pos1 = np.where(seg1 != 0, np.arange(T), 0).astype(np.int32)
    out = jax.jit(_attend("splash", seg1, pos1, None))(*alone)
    np.testing.assert_allclose(out[0, :n], packed[0, start : start + n], atol=2e-5, rtol=0)


def test_calls_a_named_splash_cannot_express_are_usage_errors():
    """A decode step (T != S) and a traced per-layer window: splash, asked for by name, stops
    with a UsageError naming the call and why, at trace time (never runs them on xla); `auto`
    on a TPU runs them on xla and records why."""
    N, K = HEADS["gqa"]
    q, k, v, seg, pos, _ = _inputs(N, K, jnp.float32)
    decode = Segments(*(jnp.asarray(x) for x in (seg[:, :2], seg, pos[:, :2], pos)))
    common = dict(scale=SCALE, out_sharding=None, interpret=True)
    with pytest.raises(
        UsageError,
        match=r"^attention implementation 'splash' cannot run a call this model makes \(causal "
        r"attention: T=2, S=128, 4/2 heads x 16, float32, packed rows, no window\): it masks by "
        r"index and needs T == S .*; use attention_impl 'auto' .* or 'xla'$",
    ):
        attention(q[:, :2], k, v, decode, implementation="splash", **common)

    rows = Segments.self_attention(jnp.asarray(seg), jnp.asarray(pos))
    run = jax.jit(
        lambda w: attention(q, k, v, rows, sliding_window=w, implementation="splash", **common)
    )
    with pytest.raises(
        UsageError, match=r"'splash' cannot run .*per-layer window \(traced\)\): it needs a sl"
    ):
        run(jnp.int32(7))


def test_auto_on_a_tpu_runs_what_splash_cannot_express_on_xla(monkeypatch):
    monkeypatch.setattr(attention_ops, "compile_platform", lambda: "tpu")
    N, K = HEADS["gqa"]
    q, k, v, seg, pos, _ = _inputs(N, K, jnp.float32)
    decode = Segments(*(jnp.asarray(x) for x in (seg[:, :2], seg, pos[:, :2], pos)))
    common = dict(scale=SCALE, out_sharding=None, interpret=True)
    with choices.recording() as chosen:
        out = attention(q[:, :2], k, v, decode, implementation="auto", **common)
    np.testing.assert_array_equal(out, attention(q[:, :2], k, v, decode, **common))
    assert [(c.backend, c.why) for c in chosen] == [
        (
            "xla",
            "auto: splash masks by index and needs T == S (query t and key t at one "
            "position), got T=2, S=128",
        )
    ]
