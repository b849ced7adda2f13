"""zoo.layers.attention against a naive reference, plus backend choice and layouts.

The reference is written independently of the module: a mask built by explicit loops over
(b, t, s) in numpy from the rule "same segment, kv_pos <= q_pos if causal, q_pos - kv_pos <
window", kv heads repeated to N (instead of grouped), -inf for masked logits (instead of a
finite minimum), and jax.nn.softmax. Every case has at least one visible key per query, so
the two formulations agree up to float rounding.

Tolerances. float32: atol 1e-5 -- the two compute the same sums in a different order (and
the implementation scales logits after the matmul in a grouped layout), which moves values
of order 1 by a few ulp (~1e-7 each) over reductions of <= 16 terms. bfloat16 inputs: atol
3e-2 against the float32 reference on the same (bf16-rounded) inputs -- the output and the
softmax probabilities are rounded to bf16 (8-bit mantissa, relative 2**-8 = 0.004) and the
outputs here are of order 1, so a few bf16 ulps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_reference import packed_rows as _packed_rows
from attention_reference import reference_attention, reference_mask
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from nnx_zoo.errors import UsageError
from zoo.layers.attention import (
    CallInfo,
    Segments,
    attention,
    choices,
    registry,
    resolve_implementation,
    ring,
)
from zoo.layers.attention import cudnn as attention_cudnn
from zoo.layers.attention import dispatch as attention_ops

ATOL_F32 = 1e-5
ATOL_BF16 = 3e-2
HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}  # name -> (N, K)
D = 8
SCALE = D**-0.5


# --- data ------------------------------------------------------------------------------------


def _case(name):
    """(q_seg, kv_seg, q_pos, kv_pos, causal, window, S) for a named masking scenario."""
    T = 16
    if name == "causal":  # one document per row, the second row padded at the end
        seg, pos = _packed_rows([[16], [11]], T)
        return seg, seg, pos, pos, True, None
    if name == "packed":  # several documents per row and padding
        seg, pos = _packed_rows([[5, 7], [3, 3, 6, 2]], T)
        return seg, seg, pos, pos, True, None
    if name == "packed_bidirectional":
        seg, pos = _packed_rows([[5, 7], [3, 3, 6, 2]], T)
        return seg, seg, pos, pos, False, None
    if name == "window":  # window of 3 visible tokens, packed rows
        seg, pos = _packed_rows([[9, 7], [3, 10]], T)
        return seg, seg, pos, pos, True, 3
    if name == "decode":
        # Two query tokens against a 12-slot cache: row 0 holds a 7-token prompt plus the
        # two new tokens (slots 0..8), row 1 a 3-token prompt (slots 0..4) -- the rest are
        # empty slots (segment 0, position 0).
        kv_seg, kv_pos = _packed_rows([[9], [5]], 12)
        q_seg = np.ones((2, 2), np.int32)
        q_pos = np.array([[7, 8], [3, 4]], np.int32)
        return q_seg, kv_seg, q_pos, kv_pos, True, None
    raise ValueError(name)


def _qkv(B, T, S, N, K, dtype=jnp.float32, seed=0):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (
        jax.random.normal(kq, (B, T, N, D), dtype),
        jax.random.normal(kk, (B, S, K, D), dtype),
        jax.random.normal(kv, (B, S, K, D), dtype),
    )


# --- running attention -----------------------------------------------------------------------


def _segments(case, packed=True):
    return Segments(*(jnp.asarray(x) for x in case[:4]), packed=packed)


def _run(q, k, v, case, *, implementation="xla", window=None, out_sharding=None, packed=True, **kw):
    causal, case_window = case[4], case[5]
    return attention(
        q,
        k,
        v,
        _segments(case, packed),
        scale=SCALE,
        out_sharding=out_sharding,
        causal=causal,
        sliding_window=case_window if window is None else window,
        implementation=implementation,
        **kw,
    )


# --- the xla path equals the reference -------------------------------------------------------

CASES = ["causal", "packed", "packed_bidirectional", "window", "decode"]


@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("case_name", CASES)
def test_xla_forward_and_gradients_equal_reference(heads, case_name):
    N, K = HEADS[heads]
    case = _case(case_name)
    q_seg, kv_seg, q_pos, kv_pos, causal, window = case
    B, T = q_seg.shape
    S = kv_seg.shape[1]
    q, k, v = _qkv(B, T, S, N, K)
    mask = reference_mask(*case[:4], causal, window)
    # The mask must actually exclude something, or the test could not see a masking bug.
    assert not mask.all()

    out = jax.jit(lambda q, k, v: _run(q, k, v, case))(q, k, v)
    ref = reference_attention(q, k, v, mask, SCALE)
    assert out.shape == (B, T, N, D) and out.dtype == jnp.float32
    np.testing.assert_allclose(out, ref, atol=ATOL_F32, rtol=0)

    # Gradients through a random projection of the output (a plain sum would hide errors
    # that cancel across positions).
    proj = jax.random.normal(jax.random.key(7), (B, T, N, D))

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v) * proj)

    grads = jax.jit(jax.grad(loss(lambda q, k, v: _run(q, k, v, case)), argnums=(0, 1, 2)))(q, k, v)
    ref_grads = jax.grad(
        loss(lambda q, k, v: reference_attention(q, k, v, mask, SCALE)), argnums=(0, 1, 2)
    )(q, k, v)
    for name, g, rg in zip("qkv", grads, ref_grads, strict=True):
        assert float(jnp.abs(rg).max()) > 1e-3, f"d{name} of the reference is ~0: weak test"
        np.testing.assert_allclose(g, rg, atol=ATOL_F32, rtol=0, err_msg=f"d{name}")


def test_packed_row_equals_documents_run_alone():
    """A document in a packed row gets the same output as the document alone in its row."""
    N, K = HEADS["gqa"]
    case = _case("packed")
    q, k, v = _qkv(2, 16, 16, N, K)
    packed = _run(q, k, v, case)
    # Row 1 holds documents of lengths 3, 3, 6, 2 from offsets 0, 3, 6, 12.
    for start, n in ((0, 3), (3, 3), (6, 6), (12, 2)):
        sl = slice(start, start + n)
        seg = jnp.ones((1, n), jnp.int32)
        pos = jnp.arange(n, dtype=jnp.int32)[None]
        alone = attention(
            q[1:, sl],
            k[1:, sl],
            v[1:, sl],
            Segments.self_attention(seg, pos),
            scale=SCALE,
            out_sharding=None,
        )
        np.testing.assert_allclose(packed[1:, sl], alone, atol=ATOL_F32, rtol=0)


def test_traced_window_under_jit():
    """One compiled function serves every per-layer window, passed in as an int32 scalar."""
    N, K = HEADS["gqa"]
    case = _case("window")
    q_seg, kv_seg, q_pos, kv_pos, causal, _ = case
    q, k, v = _qkv(2, 16, 16, N, K)
    traces = []

    @jax.jit
    def run(q, k, v, window):
        traces.append(window)
        return _run(q, k, v, case, window=window)

    for w in (3, 5, 0, -1):  # 0 and negative: no window (a global layer)
        out = run(q, k, v, jnp.int32(w))
        mask = reference_mask(q_seg, kv_seg, q_pos, kv_pos, causal, w)
        np.testing.assert_allclose(out, reference_attention(q, k, v, mask, SCALE), atol=ATOL_F32)
    assert len(traces) == 1, "the window must be a traced value, not a static argument"
    # The window changes the answer (so the test above is not passing on a no-op).
    assert float(jnp.abs(run(q, k, v, jnp.int32(3)) - run(q, k, v, jnp.int32(0))).max()) > 1e-2


def test_static_window_convention():
    """sliding_window=w: the query and the w-1 tokens before it; w=1 sees only itself."""
    seg, pos = _packed_rows([[6]], 6)
    q, k, v = _qkv(1, 6, 6, 2, 2)
    case = (seg, seg, pos, pos, True, 1)
    out = _run(q, k, v, case)
    np.testing.assert_allclose(out, v, atol=ATOL_F32)  # attending only itself returns v


def test_padding_rows_are_finite_and_full_cache_padding_query_is_not_nan():
    q_seg = np.array([[1, 0]], np.int32)  # a real query and a padding query
    kv_seg = np.ones((1, 4), np.int32)  # a full cache: the padding query sees nothing
    q_pos = np.array([[3, 0]], np.int32)
    kv_pos = np.arange(4, dtype=np.int32)[None]
    q, k, v = _qkv(1, 2, 4, 2, 1)
    out = _run(q, k, v, (q_seg, kv_seg, q_pos, kv_pos, True, None))
    assert bool(jnp.isfinite(out).all())


@pytest.mark.parametrize("heads", ["gqa", "mqa"])
def test_bfloat16_runs_and_is_close_to_float32(heads):
    N, K = HEADS[heads]
    case = _case("packed")
    q, k, v = _qkv(2, 16, 16, N, K, dtype=jnp.bfloat16)
    out = jax.jit(lambda q, k, v: _run(q, k, v, case))(q, k, v)
    assert out.dtype == jnp.bfloat16
    mask = reference_mask(*case[:4], case[4], case[5])
    ref = reference_attention(q, k, v, mask, SCALE)  # float32 on the same rounded inputs
    np.testing.assert_allclose(out.astype(jnp.float32), ref, atol=ATOL_BF16, rtol=0)
    grads = jax.grad(lambda q, k, v: _run(q, k, v, case).astype(jnp.float32).sum(), (0, 1, 2))(
        q, k, v
    )
    assert all(g.dtype == jnp.bfloat16 and bool(jnp.isfinite(g).all()) for g in grads)


def test_shape_errors_are_clear():
    q, k, v = _qkv(2, 16, 16, 4, 3)
    seg = jnp.ones((2, 16), jnp.int32)
    with pytest.raises(ValueError, match="K must divide N"):
        attention(q, k, v, Segments.self_attention(seg, seg), scale=SCALE, out_sharding=None)


# --- choosing a backend ----------------------------------------------------------------------


def _call(platform, dtype=jnp.bfloat16, head_dim=64, T=128, **kw):
    return CallInfo(dtype=dtype, head_dim=head_dim, q_len=T, kv_len=T, platform=platform, **kw)


def test_auto_picks_splash_on_tpu_cudnn_on_gpu_and_xla_elsewhere():
    f16, f32 = jnp.float16, jnp.float32
    assert jax.default_backend() == "cpu"
    assert resolve_implementation("auto", _call("cpu")) == "xla"
    assert resolve_implementation("auto", _call("cpu", interpret=True)) == "xla"
    assert resolve_implementation("auto", _call("tpu")) == "splash"
    assert resolve_implementation("auto", _call("tpu", dtype=f32, head_dim=16)) == "splash"
    assert resolve_implementation("auto", _call("tpu", T=100)) == "xla"  # not a tile multiple
    assert resolve_implementation("auto", _call("gpu", head_dim=128)) == "cudnn"
    assert resolve_implementation("auto", _call("cuda", dtype=f16)) == "cudnn"
    assert resolve_implementation("auto", _call("gpu", dtype=f32)) == "xla"
    assert resolve_implementation("auto", _call("gpu", head_dim=60)) == "xla"
    assert resolve_implementation("auto", _call("gpu", head_dim=256)) == "xla"
    assert resolve_implementation("xla", _call("gpu", dtype=f32, head_dim=60)) == "xla"
    assert resolve_implementation("cudnn", _call("gpu", head_dim=256)) == "cudnn"
    assert resolve_implementation("splash", _call("cpu", interpret=True)) == "splash"


def test_the_config_names_exactly_the_registered_backends_and_auto():
    """ATTENTION_IMPLEMENTATIONS (what a config and --attention_impl accept) and the registry
    (what runs) name the same backends: one registered but not nameable, or nameable but not
    registered, fails here. `auto` picks registered backends only."""
    from zoo.layers.config import ATTENTION_IMPLEMENTATIONS

    assert len(set(ATTENTION_IMPLEMENTATIONS)) == len(ATTENTION_IMPLEMENTATIONS)
    assert set(ATTENTION_IMPLEMENTATIONS) == {*registry.backend_names(), "auto"}
    assert set(registry._AUTO.values()) <= set(registry.backend_names())


def test_explicit_backend_that_cannot_run_says_why():
    msg = (
        "attention implementation 'cudnn' needs an NVIDIA GPU with cuDNN; "
        "this process compiles for cpu; use 'xla' or 'auto'"
    )
    with pytest.raises(UsageError) as err:
        resolve_implementation("cudnn", _call("cpu"))
    assert str(err.value) == msg
    with pytest.raises(ValueError, match="needs bfloat16 or float16 inputs, got float32"):
        resolve_implementation("cudnn", _call("gpu", dtype=jnp.float32))
    with pytest.raises(ValueError, match="multiple of 8"):
        resolve_implementation("cudnn", _call("gpu", head_dim=12))
    with pytest.raises(ValueError, match="'splash' needs a TPU .*attention_interpret=True"):
        resolve_implementation("splash", _call("cpu"))
    with pytest.raises(ValueError, match="'splash' needs sequence lengths that are multiples"):
        resolve_implementation("splash", _call("tpu", T=200))
    with pytest.raises(ValueError, match="unknown attention implementation 'flash'; valid:"):
        resolve_implementation("flash", _call("gpu"))


def test_cudnn_on_cpu_raises_our_error_at_trace_time():
    case = _case("causal")
    q, k, v = _qkv(2, 16, 16, 4, 2, dtype=jnp.bfloat16)
    # Under jit too: the error comes while tracing, before jax's "cuDNN is not detected".
    with pytest.raises(UsageError, match="needs an NVIDIA GPU with cuDNN; this process comp"):
        jax.jit(lambda q, k, v: _run(q, k, v, case, implementation="cudnn", packed=False))(q, k, v)


def test_auto_on_cpu_is_the_xla_path():
    case = _case("packed")
    q, k, v = _qkv(2, 16, 16, 4, 2)
    np.testing.assert_array_equal(
        _run(q, k, v, case, implementation="auto"), _run(q, k, v, case, implementation="xla")
    )


def _recording_xla(calls):
    xla = registry._BACKENDS["xla"].fn

    def fn(q, k, v, segments, **kwargs):
        calls.append(segments.q_ids_BT.shape)
        return xla(q, k, v, segments, **kwargs)

    return fn


LENGTHS_ONLY = dict(keeps_layout=True, packed_rows=False, equal_lengths=True, static_window=True)


def test_a_named_backend_that_cannot_express_a_call_is_a_usage_error():
    """A backend asked for by name is a promise: a call it cannot express (a packed row for a
    lengths-only backend, a decode step for an index-masking one, a traced window for one that
    needs it static) is a UsageError naming the backend, the call and why, and what would
    work -- never a quiet run on xla."""
    calls = []
    case = _case("packed")
    q, k, v = _qkv(2, 16, 16, 4, 2)
    dq, dk, dv = _qkv(2, 2, 12, 4, 2)  # a decode step: T=2 queries, S=12 cache slots
    with registry.override_backend("cudnn", _recording_xla(calls), **LENGTHS_ONLY):
        with pytest.raises(UsageError) as err:
            _run(q, k, v, case, implementation="cudnn")
        assert str(err.value) == (
            "attention implementation 'cudnn' cannot run a call this model makes (causal "
            "attention: T=S=16, 4/2 heads x 8, float32, packed rows, no window): it cannot "
            "keep the documents of packed rows apart (it takes sequence lengths, not segment "
            "ids; Segments.packed=False states one document per row); use attention_impl "
            "'auto' (it runs such calls on xla) or 'xla'"
        )
        with pytest.raises(UsageError, match=r"\(causal attention: T=2, S=12, .* needs T == S"):
            _run(dq, dk, dv, _case("decode"), implementation="cudnn", packed=False)
        with pytest.raises(UsageError, match=r"window \(traced\)\): it needs a sliding window"):
            jax.jit(lambda w: _run(q, k, v, case, implementation="cudnn", packed=False, window=w))(
                jnp.int32(3)
            )
        assert calls == []  # and nothing ran in its place
        # One document per row, T == S, static window: the backend itself runs.
        _run(q, k, v, _case("causal"), implementation="cudnn", packed=False, window=4)
        assert calls == [(2, 16)]


def test_auto_chooses_per_call_and_records_why(monkeypatch):
    """Only `auto` chooses: on a GPU its backend runs the calls it can express, xla the rest,
    and each call site's choice and reason is recorded (run_info.json's `attention`)."""
    monkeypatch.setattr(attention_ops, "compile_platform", lambda: "gpu")
    calls = []
    q, k, v = _qkv(2, 16, 16, 4, 2)
    dq, dk, dv = _qkv(2, 2, 12, 4, 2)
    with (
        registry.override_backend("cudnn", _recording_xla(calls), **LENGTHS_ONLY),
        choices.recording() as chosen,
    ):
        packed = _run(q, k, v, _case("packed"), implementation="auto")
        _run(q, k, v, _case("causal"), implementation="auto", packed=False)
        _run(q, k, v, _case("causal"), implementation="auto", packed=False)  # recorded once
        _run(dq, dk, dv, _case("decode"), implementation="auto", packed=False)
    assert calls == [(2, 16), (2, 16)]  # the unpacked self-attention, twice
    np.testing.assert_array_equal(packed, _run(q, k, v, _case("packed")))
    assert choices.to_json(chosen) == {
        "implementation": "auto",
        "calls": [
            {
                "call": "causal attention: T=S=16, 4/2 heads x 8, float32, packed rows, no window",
                "backend": "xla",
                "why": "auto: cudnn cannot keep the documents of packed rows apart (it takes "
                "sequence lengths, not segment ids; Segments.packed=False states one document "
                "per row)",
            },
            {
                "call": "causal attention: T=S=16, 4/2 heads x 8, float32, one document "
                "per row, no window",
                "backend": "cudnn",
                "why": "auto: cudnn on gpu",
            },
            {
                "call": "causal attention: T=2, S=12, 4/2 heads x 8, float32, one document per "
                "row, no window",
                "backend": "xla",
                "why": "auto: cudnn masks by index and needs T == S (query t and key t at one "
                "position), got T=2, S=12",
            },
        ],
    }


def test_the_ring_refuses_blocks_a_named_backend_cannot_run_and_auto_runs_them_on_xla():
    """Context parallelism's ring picks its blocks' kernel: a named splash with a window (its
    index masks cannot say one) or a named cudnn (no ring form) is a UsageError naming the
    call; `auto` runs those blocks on xla and says why."""
    tpu = dict(dtype=jnp.bfloat16, head_dim=64, block_len=512, balanced=True, platform="tpu")
    tpu.update(interpret=False, call="the ring")
    gpu = {**tpu, "platform": "gpu"}
    assert ring.block_kernel("splash", sliding_window=None, **tpu) == (
        "splash",
        "asked for by name",
    )
    masks = "runs the ring's blocks by index masks, which cannot say a sliding window"
    with pytest.raises(UsageError, match=rf"'splash' cannot run .* \(the ring\): it {masks}; use"):
        ring.block_kernel("splash", sliding_window=128, **tpu)
    assert ring.block_kernel("auto", sliding_window=128, **tpu) == ("xla", f"auto: splash {masks}")
    with pytest.raises(UsageError, match=r"'cudnn' cannot run .* it has no ring form"):
        ring.block_kernel("cudnn", sliding_window=None, **gpu)
    kernel, why = ring.block_kernel("auto", sliding_window=None, **gpu)
    assert kernel == "xla" and why.startswith("auto: cudnn has no ring form")


@pytest.mark.parametrize("packed", [False, True], ids=["lengths", "mask"])
def test_cudnn_arguments_match_our_semantics(packed):
    """The cuDNN backend's arguments (sequence lengths for unpacked rows, the document mask
    as `mask=` for packed rows, window (w-1, 0), is_causal) are exact for the rows each form
    is given; checked by running the same arguments through jax's xla path."""
    if packed:
        seg, pos = _packed_rows([[5, 7], [3, 3, 6, 2]], 16)
    else:
        seg, pos = _packed_rows([[16], [11]], 16)  # one document per row, padding at the end
    q, k, v = _qkv(2, 16, 16, 4, 2)
    real = jnp.asarray(seg != 0)[:, :, None, None]  # padding queries' outputs are ignored
    for window in (None, 3):
        case = (seg, seg, pos, pos, True, window)
        ours = _run(q, k, v, case)
        theirs = attention_cudnn.cudnn_attention(
            q,
            k,
            v,
            _segments(case, packed),
            scale=SCALE,
            causal=True,
            sliding_window=window,
            out_sharding=None,
            jax_implementation="xla",
        )
        np.testing.assert_allclose(
            jnp.where(real, ours, 0), jnp.where(real, theirs, 0), atol=ATOL_F32
        )


# --- layouts under an explicit (4, 2) mesh ---------------------------------------------------


@pytest.fixture(scope="module")
def mesh():
    assert len(jax.devices()) == 8, "tests/conftest.py must force 8 CPU devices before jax"
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)


HEADS_SPEC = P("data", None, "model", None)


@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("case_name", ["packed", "window"])
def test_xla_keeps_head_sharding_and_values(mesh, heads, case_name):
    N, K = HEADS[heads]
    case = _case(case_name)
    q_seg, kv_seg, q_pos, kv_pos, causal, window = case
    q, k, v = _qkv(8, 16, 16, N, K, seed=1)
    tok = [np.tile(x, (4, 1)) for x in (q_seg, kv_seg, q_pos, kv_pos)]  # B = 8
    unsharded = _run(q, k, v, (*tok, causal, window))
    kv_spec = HEADS_SPEC if K % 2 == 0 else P("data", None, None, None)  # MQA: K=1 replicated
    with jax.set_mesh(mesh):
        qs = jax.sharding.reshard(q, HEADS_SPEC)
        ks, vs = (jax.sharding.reshard(x, kv_spec) for x in (k, v))
        toks = [jax.sharding.reshard(jnp.asarray(x), P("data", None)) for x in tok]

        @jax.jit
        def fwd_bwd(q, k, v, w):
            def f(q, k, v):
                out = _run(q, k, v, (*toks, causal, None), window=w, out_sharding=HEADS_SPEC)
                return jnp.sum(out**2), out

            return jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(q, k, v)

        (_, out), (dq, dk, dv) = fwd_bwd(qs, ks, vs, jnp.int32(window or 0))
        assert str(jax.typeof(out)) == f"float32[8@data,16,{N}@model,{D}]"
        assert jax.typeof(dq).sharding.spec == jax.typeof(qs).sharding.spec
        assert jax.typeof(dk).sharding.spec == jax.typeof(ks).sharding.spec
        assert jax.typeof(dv).sharding.spec == jax.typeof(vs).sharding.spec
    np.testing.assert_allclose(out, unsharded, atol=ATOL_F32, rtol=0)


def test_decode_under_mesh(mesh):
    N, K = HEADS["gqa"]
    case = _case("decode")
    q_seg, kv_seg, q_pos, kv_pos, causal, window = case
    q, k, v = _qkv(8, 2, 12, N, K)
    tok = [np.tile(x, (4, 1)) for x in (q_seg, kv_seg, q_pos, kv_pos)]
    unsharded = _run(q, k, v, (*tok, causal, window))
    with jax.set_mesh(mesh):
        qs, ks, vs = (jax.sharding.reshard(x, HEADS_SPEC) for x in (q, k, v))
        out = jax.jit(
            lambda q, k, v: _run(q, k, v, (*tok, causal, window), out_sharding=HEADS_SPEC)
        )(qs, ks, vs)
        assert str(jax.typeof(out)) == f"float32[8@data,2,{N}@model,{D}]"
    np.testing.assert_allclose(out, unsharded, atol=ATOL_F32, rtol=0)


def _dropping_backend(*args, **kwargs):
    """Stand-in for the cuDNN call: right numbers, layout dropped (typed unsharded) where
    there are explicit axes, i.e. outside shard_map."""
    out = registry._BACKENDS["xla"].fn(*args, **kwargs)
    return jax.sharding.reshard(out, P()) if jax.sharding.get_abstract_mesh().explicit_axes else out


@pytest.mark.parametrize("keeps_layout", [False, True])
def test_dispatcher_restores_the_layout_of_untrusted_backends(mesh, keeps_layout):
    """keeps_layout=False: the backend runs per device inside shard_map and the output has
    the declared layout. keeps_layout=True (trusting a backend that drops it): the dropped
    layout comes through, so it is the dispatcher, not the backend, that restores it. (The
    train-step version, gradients included, is tests/test_attention_layout.py.)"""
    N, K = HEADS["gqa"]
    case = _case("packed")
    q, k, v = _qkv(2, 16, 16, N, K)
    tok = [np.tile(x, (4, 1)) for x in case[:4]]
    q, k, v = (jnp.tile(x, (4, 1, 1, 1)) for x in (q, k, v))
    with jax.set_mesh(mesh):
        qs, ks, vs = (jax.sharding.reshard(x, HEADS_SPEC) for x in (q, k, v))
        with registry.override_backend("dropper", _dropping_backend, keeps_layout=keeps_layout):
            out = jax.jit(
                lambda q, k, v: _run(
                    q, k, v, (*tok, True, None), implementation="dropper", out_sharding=HEADS_SPEC
                )
            )(qs, ks, vs)
        want = HEADS_SPEC if not keeps_layout else P(None, None, None, None)
        assert jax.typeof(out).sharding.spec == want
    assert "dropper" not in registry.backend_names()
