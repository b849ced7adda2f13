"""Ring attention (context_parallel=ring) against a naive one-device reference, forward and
gradients, and what it compiles to.

The attention call alone, on a data:2 x context:4 mesh: packed rows whose documents cross the
context blocks, GQA, no window / a static window / a per-layer (traced) window, and the
load-balanced chunk order the model runs in. Tolerances: float32; the ring sums each query's
keys in c blocks combined by log-sum-exp, one device in one softmax, so they agree to rounding
of O(1) values: 2e-6 absolute on outputs, 1e-5 on gradients.

Compiled (CPU, 8 devices; the train step of the tiny model under fsdp_cp data:2 x context:4):
ring has collective-permutes over `context` and no all-gather over it (the K/V gather of
all_gather), and its attention temporaries shrink: at T = 512 per row the step's temp bytes
are below all_gather's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from attention_reference import packed_rows, reference_attention, reference_mask
from flax import nnx
from jax.sharding import PartitionSpec as P
from model_utils import put_batch

from nnx_zoo.training.loop import Trainer
from nnx_zoo.training.step_memory import step_memory
from shardings import get_strategy
from shardings.hlo import collectives
from zoo import create_model, get_config
from zoo.layers.attention import context_parallel, ring, ring_splash

B, T, N, K, D = 2, 64, 4, 2, 8
CONTEXT = 4
SCALE = D**-0.5


@pytest.fixture(scope="module")
def mesh():
    return get_strategy("fsdp_cp").make_mesh(shape=(2, CONTEXT))


def _inputs():
    rng = np.random.default_rng(0)
    q = rng.normal(size=(B, T, N, D)).astype(np.float32)
    k = rng.normal(size=(B, T, K, D)).astype(np.float32)
    v = rng.normal(size=(B, T, K, D)).astype(np.float32)
    # Documents of odd lengths, crossing the 16-token blocks; row 1 ends in padding.
    seg, pos = packed_rows([[23, 9, 32], [5, 40, 11]], T)
    cotangent = rng.normal(size=(B, T, N, D)).astype(np.float32)
    return q, k, v, seg, pos, cotangent


def _reference(q, k, v, seg, pos, cotangent, window):
    mask = reference_mask(seg, seg, pos, pos, True, window)

    def loss(q, k, v):
        out = reference_attention(q, k, v, mask, SCALE)
        return jnp.sum(out * cotangent), out

    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return np.asarray(out), [np.asarray(g) for g in grads]


def _ring(
    mesh,
    q,
    k,
    v,
    seg,
    pos,
    cotangent,
    window,
    *,
    traced_window=False,
    balanced=False,
    implementation="xla",
):
    T, context = q.shape[1], mesh.shape["context"]
    order = context_parallel.balanced_order(T, context) if balanced else np.arange(T)
    inverse = np.argsort(order)
    qkv_spec, tok_spec = P("data", "context", None, None), P("data", "context")
    with jax.set_mesh(mesh):
        put = lambda x, spec: jax.device_put(jnp.asarray(x[:, order]), spec)  # noqa: E731
        args = [put(x, qkv_spec) for x in (q, k, v, cotangent)]
        seg_d, pos_d = put(seg, tok_spec), put(pos, tok_spec)

        @jax.jit
        def run(q, k, v, cot, w):
            def loss(q, k, v):
                out = context_parallel.attention(
                    q,
                    k,
                    v,
                    segment_ids_BT=seg_d,
                    positions_BT=pos_d,
                    axis="context",
                    scale=SCALE,
                    sliding_window=w if traced_window else window,
                    implementation=implementation,
                    out_sharding=None,
                    method="ring",
                    balanced=balanced,
                    interpret=implementation == "splash",
                )
                return jnp.sum(out * cot), out

            return jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)

        (_, out), grads = run(*args, jnp.int32(window or 0))
    return np.asarray(out)[:, inverse], [np.asarray(g)[:, inverse] for g in grads]


@pytest.mark.parametrize(
    "window, traced, balanced, query_chunk",
    [
        (None, False, False, None),
        (None, False, True, None),
        (7, False, True, None),
        (7, True, True, None),
        # Each device's 16 queries in 4 chunks of 4 (long rows run in chunks of 1024).
        (7, True, True, 4),
    ],
    ids=["natural", "balanced", "window", "traced-window", "query-chunks"],
)
def test_ring_equals_one_device_forward_and_gradients(
    mesh, monkeypatch, window, traced, balanced, query_chunk
):
    if query_chunk is not None:
        monkeypatch.setattr(ring, "QUERY_CHUNK", query_chunk)
        assert ring._chunks(T // CONTEXT) == 4
    q, k, v, seg, pos, cot = _inputs()
    want_out, want_grads = _reference(q, k, v, seg, pos, cot, window)
    out, grads = _ring(
        mesh, q, k, v, seg, pos, cot, window, traced_window=traced, balanced=balanced
    )
    np.testing.assert_allclose(out, want_out, atol=2e-6, rtol=0)
    for name, got, want in zip("qkv", grads, want_grads, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0, err_msg=f"d{name}")


def _compiled_step(context_parallel_method: str, seq_len: int, batch: int = 2):
    """The tiny model's compiled train step under fsdp_cp data:2 x context:4."""
    cfg = get_config("tiny", remat="full", context_parallel=context_parallel_method)
    strategy = get_strategy("fsdp_cp")
    mesh = strategy.make_mesh(shape=(2, CONTEXT))
    with jax.set_mesh(mesh):
        model = create_model(cfg, strategy, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
        trainer = Trainer(model, optimizer, batch_spec=strategy.batch_spec())
        seg = np.ones((batch, seq_len), np.int32)
        pos = np.tile(np.arange(seq_len, dtype=np.int32), (batch, 1))
        rows = {"tokens": pos % cfg.vocab_size, "segment_ids": seg, "positions": pos}
        trainer.compile(put_batch(rows, strategy.batch_spec()))
    return trainer.compiled, dict(mesh.shape)


@pytest.fixture(scope="module")
def long_rows():
    """{method: (temp bytes, collectives)} of the step at T = 512."""
    out = {}
    for method in ("all_gather", "ring"):
        compiled, mesh_shape = _compiled_step(method, 512)
        ops = collectives(compiled.as_text(), mesh_shape)
        out[method] = (step_memory(compiled).temp_bytes, ops)
    return out


def test_ring_permutes_over_context_and_gathers_nothing_over_it(long_rows):
    for method, (_, ops) in long_rows.items():
        permutes = [o for o in ops if o.op == "collective-permute" and o.axes == ("context",)]
        # Float arrays: K/V. (The loss's next-token shift gathers int32 token ids over
        # `context` under both methods, outside the layers.)
        gathers = [
            o
            for o in ops
            if o.op == "all-gather" and o.axes == ("context",) and set(o.dtypes) & {"f32", "bf16"}
        ]
        if method == "all_gather":
            # K, V (and their ids / positions) gathered whole over `context`, every layer.
            assert gathers, "all_gather should gather K/V over context"
        else:
            assert not gathers, [(o.name, o.array_bytes) for o in gathers]
            # Per layer forward: K/V blocks sent c-1 = 3 times; backward: 3 more, plus dK/dV
            # 4 times (remat=full recomputes the forward's).
            assert sum(o.executions for o in permutes) >= 2 * 3 * 2, permutes


def test_ring_attention_temporaries_are_below_all_gathers(long_rows):
    gather_temp, ring_temp = long_rows["all_gather"][0], long_rows["ring"][0]
    print(f"\ntemp bytes per device, T=512 x 2 rows: all_gather {gather_temp}, ring {ring_temp}")
    assert ring_temp < gather_temp, (gather_temp, ring_temp)


def test_ring_with_splash_blocks_equals_one_device(monkeypatch):
    # The TPU path (ring_splash.py) in Pallas interpret mode, context 2: each device's 256
    # tokens and the half blocks of 128 the kernel tiles. Every row is documents to its end:
    # splash masks by index, so a padding query would see fewer padding keys than one device.
    calls = []
    original = ring_splash._forward
    monkeypatch.setattr(ring_splash, "_forward", lambda *a: calls.append(a[0]) or original(*a))
    mesh = get_strategy("fsdp_cp").make_mesh(shape=(4, 2))
    rng = np.random.default_rng(1)
    length = 512
    q = rng.normal(size=(4, length, N, D)).astype(np.float32)
    k, v = (rng.normal(size=(4, length, K, D)).astype(np.float32) for _ in range(2))
    cot = rng.normal(size=q.shape).astype(np.float32)
    seg, pos = packed_rows([[512], [100, 300, 112], [257, 255], [3, 128, 128, 253]], length)
    want_out, want_grads = _reference(q, k, v, seg, pos, cot, None)
    out, grads = _ring(mesh, q, k, v, seg, pos, cot, None, balanced=True, implementation="splash")
    assert calls, "the ring did not run splash blocks"
    np.testing.assert_allclose(out, want_out, atol=2e-6, rtol=0)
    for name, got, want in zip("qkv", grads, want_grads, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0, err_msg=f"d{name}")
