"""The attention function every family calls, with pluggable backends (xla, cudnn, auto).

Dims: B batch, T query positions, S key/value positions, N query heads, K key/value heads,
G = N // K query heads per kv head (MHA G=1, GQA, MQA K=1), D head dim.

Masking is by segment ids and positions, which serves packed training rows and KV caches
alike. Query t attends key s iff

    q_seg[t] == kv_seg[s]
    and (not causal or kv_pos[s] <= q_pos[t])
    and (no window or q_pos[t] - kv_pos[s] < sliding_window)

so `sliding_window=w` shows a query itself and the w-1 tokens before it (w visible tokens,
the query included; the window bounds only the past). This is the convention of
`DecoderConfig.sliding_window`, and of Hugging Face Mistral / Gemma 3 configs (checked
against transformers 5.23 in tests/hf_reference). `jax.nn.dot_product_attention`'s
`local_window_size=(l, 0)` counts differently (l = w - 1 tokens to the left).

Segment id 0 is padding (or an empty cache slot). Padding queries attend padding keys
(all at position 0), so no row is fully masked and nothing is NaN; the loss ignores them.
A query with no visible key at all (e.g. a padding query against a full cache) gets a
uniform average rather than NaN, because masked logits are a finite minimum, not -inf.

Backends live in a registry (`register_backend`, `override_backend`). Each says whether its
output keeps the declared layout under an explicit mesh (`keeps_layout`) and whether it
honours arbitrary segment ids / positions (`segment_aware`); the dispatcher runs the ones
that do not keep layouts inside shard_map (see `_per_shard`), and sends what a
segment-unaware backend cannot do to xla.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

# Where a mask excludes a logit. Finite, not -inf: a row with nothing visible then softmaxes
# to a uniform average instead of NaN, and its gradient stays finite.
_MASKED_LOGIT = float(np.finfo(np.float32).min)

# Platforms on which the cuDNN path can run. jax reports NVIDIA GPUs as 'gpu' (and the
# plugin as 'cuda' in some builds); ROCm is also 'gpu', where jax's own error then applies.
_GPU_PLATFORMS = ("gpu", "cuda")
_CUDNN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# cuDNN flash attention: head dim a multiple of 8, at most 128 before Hopper and 256 on it.
# `auto` keeps to 128 (safe on every generation); an explicit 'cudnn' allows up to 256 and
# leaves the pre-Hopper case to jax's own check.
_CUDNN_AUTO_MAX_HEAD_DIM = 128
_CUDNN_MAX_HEAD_DIM = 256

# A backend: fn(q_BTND, k_BSKD, v_BSKD, *, q_segment_ids_BT, kv_segment_ids_BS,
# q_positions_BT, kv_positions_BS, scale, causal, sliding_window, out_sharding) -> out_BTND.
BackendFn = Callable[..., jax.Array]
# Why a backend cannot run here, or None: (dtype, head_dim, platform, max_head_dim) -> str.
UnavailableFn = Callable[[Any, int, str, int], "str | None"]


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    name: str
    fn: BackendFn
    # True: under an explicit mesh the output (and the gradients of q, k, v) are already
    # typed with their layouts (the backend builds them with out_sharding-aware ops).
    # False: a black box to sharding types (the cuDNN custom call); the dispatcher runs it
    # per device inside jax.shard_map and reshards the result to `out_sharding`.
    keeps_layout: bool
    # True: honours any segment ids and positions (packed rows, KV caches, traced windows).
    # False: only gets rows with one document starting at index 0 (positions == index,
    # padding only at the end), T == S, and a static window used with causal masking;
    # anything else goes to xla (with a one-time warning when it was asked for by name).
    segment_aware: bool
    unavailable: UnavailableFn


_BACKENDS: dict[str, AttentionBackend] = {}
_WARNED: set[tuple[str, str]] = set()


def _always_available(dtype, head_dim, platform, max_head_dim) -> str | None:
    del dtype, head_dim, platform, max_head_dim
    return None


def register_backend(
    name: str,
    fn: BackendFn,
    *,
    keeps_layout: bool,
    segment_aware: bool = True,
    unavailable: UnavailableFn | None = None,
    replace: bool = False,
) -> AttentionBackend:
    """Adds `fn` as implementation `name`; `replace=True` to swap out an existing one."""
    if name == "auto":
        raise ValueError("'auto' is a choice between backends, not a backend")
    if name in _BACKENDS and not replace:
        raise ValueError(f"attention backend {name!r} already registered; pass replace=True")
    backend = AttentionBackend(
        name=name,
        fn=fn,
        keeps_layout=keeps_layout,
        segment_aware=segment_aware,
        unavailable=unavailable or _always_available,
    )
    _BACKENDS[name] = backend
    return backend


@contextlib.contextmanager
def override_backend(
    name: str, fn: BackendFn, *, keeps_layout: bool, segment_aware: bool = True
) -> Iterator[AttentionBackend]:
    """Registers `fn` as `name` (available on every platform) for the `with` block only.

    For tests: e.g. a stand-in for 'cudnn' that drops the layout, as the cuDNN call does,
    reached through a model whose config only names 'xla' / 'cudnn' / 'auto'.
    """
    previous = _BACKENDS.get(name)
    try:
        yield register_backend(
            name, fn, keeps_layout=keeps_layout, segment_aware=segment_aware, replace=True
        )
    finally:
        if previous is None:
            _BACKENDS.pop(name, None)
        else:
            _BACKENDS[name] = previous


def backend_names() -> tuple[str, ...]:
    return tuple(sorted(_BACKENDS))


def resolve_implementation(
    name: str, *, dtype, head_dim: int, platform: str, packed: bool = False
) -> str:
    """The registered backend that `name` runs on; pure, so the GPU branch is testable on CPU.

    'auto': 'cudnn' when it is available here (GPU platform, bf16/fp16, head dim a multiple
    of 8 and <= 128) and the rows are not packed (or the registered cudnn is segment-aware),
    else 'xla'. A backend asked for by name that cannot run here raises ValueError saying
    why, at trace time, before jax's own (less clear) error.
    """
    if name == "auto":
        cudnn = _BACKENDS.get("cudnn")
        if (
            cudnn is not None
            and cudnn.unavailable(dtype, head_dim, platform, _CUDNN_AUTO_MAX_HEAD_DIM) is None
            and (cudnn.segment_aware or not packed)
        ):
            return "cudnn"
        return "xla"
    if name not in _BACKENDS:
        valid = ", ".join((*backend_names(), "auto"))
        raise ValueError(f"unknown attention implementation {name!r}; valid: {valid}")
    reason = _BACKENDS[name].unavailable(dtype, head_dim, platform, _CUDNN_MAX_HEAD_DIM)
    if reason is not None:
        raise ValueError(f"attention implementation {name!r} {reason}; use 'xla' or 'auto'")
    return name


def attention(
    q_BTND: jax.Array,
    k_BSKD: jax.Array,
    v_BSKD: jax.Array,
    *,
    q_segment_ids_BT: jax.Array,
    kv_segment_ids_BS: jax.Array,
    q_positions_BT: jax.Array,
    kv_positions_BS: jax.Array,
    scale: float,
    out_sharding: P | None,
    causal: bool = True,
    sliding_window: int | jax.Array | None = None,
    implementation: str = "xla",
    packed: bool = True,
) -> jax.Array:
    """Softmax attention of q over k/v under the segment/position mask; out_BTND, q's dtype.

    sliding_window: None, a Python int, or a (traced) int32 scalar -- e.g. the per-layer
      value of layers stacked under nnx.scan; a value <= 0 means no window.
    out_sharding: the declared layout of the output (None: q's layout).
    packed: whether a row may hold more than one document. Segment ids are traced, so this
      cannot be read off the data at trace time; the caller states it. True (the default)
      is always correct. A segment-unaware backend (the public cuDNN path, which takes
      sequence lengths and not segment ids) runs only with packed=False, where each row is
      one document from index 0 followed by padding; with packed=True the call falls back
      to xla with a one-time warning rather than attend across documents.
    """
    _check_shapes(
        q_BTND, k_BSKD, v_BSKD, q_segment_ids_BT, kv_segment_ids_BS, q_positions_BT, kv_positions_BS
    )
    name = resolve_implementation(
        implementation,
        dtype=q_BTND.dtype,
        head_dim=q_BTND.shape[-1],
        platform=jax.default_backend(),
        packed=packed,
    )
    backend = _BACKENDS[name]
    if not backend.segment_aware:
        reason = _segment_unaware_limit(q_BTND, k_BSKD, packed, causal, sliding_window)
        if reason is not None:
            if implementation != "auto":
                _warn_once(name, reason)
            backend = _BACKENDS["xla"]

    call = dict(
        q_segment_ids_BT=q_segment_ids_BT,
        kv_segment_ids_BS=kv_segment_ids_BS,
        q_positions_BT=q_positions_BT,
        kv_positions_BS=kv_positions_BS,
        scale=scale,
        causal=causal,
        sliding_window=sliding_window,
    )
    if backend.keeps_layout or not _explicit_axes():
        out_BTND = backend.fn(q_BTND, k_BSKD, v_BSKD, **call, out_sharding=out_sharding)
    else:
        out_BTND = _per_shard(backend.fn, q_BTND, k_BSKD, v_BSKD, **call)
        if out_sharding is not None:
            out_BTND = _reshard_to(out_BTND, out_sharding)
    return out_BTND.astype(q_BTND.dtype)


def _per_shard(fn: BackendFn, q_BTND, k_BSKD, v_BSKD, *, sliding_window, **call) -> jax.Array:
    """The layout fix: run a black-box backend inside jax.shard_map over batch and heads.

    The cuDNN custom call's abstract values carry no sharding outside shard_map: its output
    *and* the q/k/v gradients of its custom_vjp come back typed unsharded, although q, k, v
    were `B/data T N/model D`. Forward, an out-projection that names its output layout then
    silently all-gathers the whole attention output onto every device; one that does not
    (fsdp_tp kernel `N/model D M/data`) returns `B T M/data`, and the next op that meets a
    declared layout fails at trace time with a ShardingTypeError (`dot_general requires
    contracting dimensions to have consistent sharding, got ('data',) and ('model',)`, or
    `add got incompatible shardings` at the residual). `jax.sharding.reshard(out, spec)`
    after the call fixes only the forward. Backward, jax rejects
    the unsharded gradients against the sharded primal inputs (`Custom VJP bwd rule must
    produce an output with the same type as the args tuple of the primal function`), which
    no reshard after the call can reach. Inside shard_map every device runs the call on its
    own `B/data`, `N/model` block (a plain local attention: heads and batch rows are
    independent), types are per-device and consistent in both directions, and out_specs
    gives the result its layout back.

    Sequence dims are gathered: a segment-unaware backend masks by index, which would be
    wrong on a block of queries. Heads split as the xla path splits them (`_plan_layout`),
    so each device holds the kv heads of its query heads.
    """
    lay = _plan_layout(q_BTND, k_BSKD, split_queries=False)
    args = [q_BTND, k_BSKD, v_BSKD]
    specs = [lay.q, lay.kv, lay.kv]
    for name in ("q_segment_ids_BT", "q_positions_BT", "kv_segment_ids_BS", "kv_positions_BS"):
        args.append(call.pop(name))
        specs.append(lay.q_tokens if name.startswith("q_") else lay.kv_tokens)
    static_window = _is_static(sliding_window)
    if not static_window:  # a traced per-layer window enters as an argument, replicated
        args.append(jnp.asarray(sliding_window, jnp.int32))
        specs.append(P())
    args = [_reshard_to(x, spec) for x, spec in zip(args, specs, strict=True)]

    def local(q, k, v, q_seg, q_pos, kv_seg, kv_pos, *window):
        return fn(
            q,
            k,
            v,
            q_segment_ids_BT=q_seg,
            q_positions_BT=q_pos,
            kv_segment_ids_BS=kv_seg,
            kv_positions_BS=kv_pos,
            sliding_window=sliding_window if static_window else window[0],
            out_sharding=None,  # no explicit axes inside: layouts are shard_map's
            **call,
        )

    return jax.shard_map(local, in_specs=tuple(specs), out_specs=lay.out)(*args)


# --- the mask ------------------------------------------------------------------------------


def attention_mask(
    q_segment_ids_BT: jax.Array,
    kv_segment_ids_BS: jax.Array,
    q_positions_BT: jax.Array,
    kv_positions_BS: jax.Array,
    *,
    causal: bool,
    sliding_window: int | jax.Array | None,
) -> jax.Array:
    """mask_BTS: True where query t may attend key s (see the module docstring)."""
    mask_BTS = q_segment_ids_BT[:, :, None] == kv_segment_ids_BS[:, None, :]
    q_pos_BT1 = q_positions_BT[:, :, None]
    kv_pos_B1S = kv_positions_BS[:, None, :]
    if causal:
        mask_BTS &= kv_pos_B1S <= q_pos_BT1
    if _is_static(sliding_window):
        if sliding_window is not None and sliding_window > 0:
            mask_BTS &= q_pos_BT1 - kv_pos_B1S < sliding_window
    else:
        window = jnp.asarray(sliding_window, jnp.int32)
        mask_BTS &= (window <= 0) | (q_pos_BT1 - kv_pos_B1S < window)
    return mask_BTS


def _is_static(sliding_window) -> bool:
    if isinstance(sliding_window, bool):
        raise TypeError("sliding_window must be None, an int or an int32 scalar, not a bool")
    return sliding_window is None or isinstance(sliding_window, int | np.integer)


# --- xla: einsums with every layout declared --------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Specs of the xla path's intermediates under an explicit mesh, derived from q's layout.

    Heads stay split the way q's are: on the kv-head dim K when K divides over the head
    axis (MHA, GQA), on the group dim G when K == 1 (MQA, kv replicated), else q's heads
    are gathered. jax.nn.dot_product_attention(implementation='xla') vmaps over G, which
    fails for MQA under tensor parallelism ("Mapped away dimension of inputs passed to
    vmap should be sharded the same"), hence einsums with explicit out_sharding here.
    """

    q: P  # [B, T, N, D]
    kv: P  # [B, S, K, D]
    q_tokens: P  # [B, T]
    kv_tokens: P  # [B, S]
    grouped: P  # [B, T, K, G, D], q and the output before merging heads
    logits: P  # [B, K, G, T, S]
    out: P  # [B, T, N, D]


def _explicit_axes() -> frozenset[str]:
    mesh = jax.sharding.get_abstract_mesh()
    return frozenset() if mesh.empty else frozenset(mesh.explicit_axes)


def _keep_explicit(entry, explicit: frozenset[str]):
    if entry is None:
        return None
    names = entry if isinstance(entry, tuple) else (entry,)
    kept = tuple(n for n in names if n in explicit)
    if not kept:
        return None
    return kept[0] if len(kept) == 1 else kept


def _axis_size(entry) -> int:
    if entry is None:
        return 1
    names = entry if isinstance(entry, tuple) else (entry,)
    shape = jax.sharding.get_abstract_mesh().shape
    return math.prod(shape[n] for n in names)


def _plan_layout(
    q_BTND: jax.Array, k_BSKD: jax.Array, *, split_queries: bool = True
) -> _Layout | None:
    explicit = _explicit_axes()
    if not explicit:
        return None
    q_spec = tuple(jax.typeof(q_BTND).sharding.spec) + (None,) * 4
    k_spec = tuple(jax.typeof(k_BSKD).sharding.spec) + (None,) * 4
    qb, qt, heads = (_keep_explicit(e, explicit) for e in q_spec[:3])
    if not split_queries:
        qt = None
    kv_heads_now = _keep_explicit(k_spec[2], explicit)
    K = k_BSKD.shape[2]
    if heads is None:
        kv_heads, group = None, None
    elif K == 1:
        kv_heads, group = None, heads  # MQA: every device needs the one kv head
    elif kv_heads_now == heads or K % _axis_size(heads) == 0:
        # A K split over the head axis keeps each device's q heads next to their kv heads;
        # from replicated kv that is a local slice, no communication.
        kv_heads, group = heads, None
    else:
        # Head counts that do not split evenly into groups: gather q's heads (rare; no
        # strategy here makes it, since the model axis is chosen to divide K).
        heads, kv_heads, group = None, None, None
    # The key sequence dim is gathered (context parallelism is not supported here) and D is
    # never split: both are contracted or reduced within a device.
    return _Layout(
        q=P(qb, qt, heads, None),
        kv=P(qb, None, kv_heads, None),
        q_tokens=P(qb, qt),
        kv_tokens=P(qb, None),
        grouped=P(qb, qt, kv_heads, group, None),
        logits=P(qb, kv_heads, group, qt, None),
        out=P(qb, qt, heads, None),
    )


def _reshard_to(x: jax.Array, spec: P) -> jax.Array:
    """reshard only when the layout differs, so the common case adds nothing to the graph."""
    rank = x.ndim
    now = tuple(jax.typeof(x).sharding.spec) + (None,) * (rank - len(jax.typeof(x).sharding.spec))
    want = tuple(spec) + (None,) * (rank - len(spec))
    return x if now == want else jax.sharding.reshard(x, P(*want))


def _xla_attention(
    q_BTND,
    k_BSKD,
    v_BSKD,
    *,
    q_segment_ids_BT,
    kv_segment_ids_BS,
    q_positions_BT,
    kv_positions_BS,
    scale,
    causal,
    sliding_window,
    out_sharding,
):
    B, T, N, D = q_BTND.shape
    K = k_BSKD.shape[2]
    G = N // K
    lay = _plan_layout(q_BTND, k_BSKD)
    if lay is not None:
        q_BTND = _reshard_to(q_BTND, lay.q)
        k_BSKD = _reshard_to(k_BSKD, lay.kv)
        v_BSKD = _reshard_to(v_BSKD, lay.kv)
        q_segment_ids_BT = _reshard_to(q_segment_ids_BT, lay.q_tokens)
        q_positions_BT = _reshard_to(q_positions_BT, lay.q_tokens)
        kv_segment_ids_BS = _reshard_to(kv_segment_ids_BS, lay.kv_tokens)
        kv_positions_BS = _reshard_to(kv_positions_BS, lay.kv_tokens)

    def spec(name):
        return None if lay is None else getattr(lay, name)

    mask_BTS = attention_mask(
        q_segment_ids_BT,
        kv_segment_ids_BS,
        q_positions_BT,
        kv_positions_BS,
        causal=causal,
        sliding_window=sliding_window,
    )
    q_BTKGD = jnp.reshape(q_BTND, (B, T, K, G, D), out_sharding=spec("grouped"))
    # Logits, softmax and the weighted sum accumulate in float32 whatever the input dtype
    # (as jax.nn.dot_product_attention and the cuDNN kernel do); probabilities are cast
    # back to v's dtype for the second matmul.
    logits_BKGTS = jnp.einsum(
        "BTKGD,BSKD->BKGTS",
        q_BTKGD,
        k_BSKD,
        preferred_element_type=jnp.float32,
        out_sharding=spec("logits"),
    )
    logits_BKGTS = jnp.where(mask_BTS[:, None, None], logits_BKGTS * scale, _MASKED_LOGIT)
    probs_BKGTS = jax.nn.softmax(logits_BKGTS, axis=-1).astype(v_BSKD.dtype)
    out_BTKGD = jnp.einsum(
        "BKGTS,BSKD->BTKGD",
        probs_BKGTS,
        v_BSKD,
        preferred_element_type=jnp.float32,
        out_sharding=spec("grouped"),
    )
    out_BTND = jnp.reshape(out_BTKGD, (B, T, N, D), out_sharding=spec("out"))
    out_BTND = out_BTND.astype(q_BTND.dtype)
    if lay is not None and out_sharding is not None:
        # The output comes out in q's (possibly head-gathered) layout; reshard only when the
        # declared one differs, so the usual case (declared == q's) adds nothing.
        out_BTND = _reshard_to(out_BTND, out_sharding)
    return out_BTND


# --- cudnn: the public jax.nn.dot_product_attention path -----------------------------------


def _cudnn_unavailable(dtype, head_dim: int, platform: str, max_head_dim: int) -> str | None:
    if platform not in _GPU_PLATFORMS:
        return f"needs an NVIDIA GPU with cuDNN; this process has platform {platform}"
    if jnp.dtype(dtype) not in _CUDNN_DTYPES:
        return f"needs bfloat16 or float16 inputs, got {jnp.dtype(dtype).name}"
    if head_dim % 8 or head_dim > max_head_dim:
        return f"needs a head dim that is a multiple of 8 and <= {max_head_dim}, got {head_dim}"
    return None


def _public_path(
    q_BTND,
    k_BSKD,
    v_BSKD,
    *,
    q_segment_ids_BT,
    kv_segment_ids_BS,
    q_positions_BT,
    kv_positions_BS,
    scale,
    causal,
    sliding_window,
    out_sharding,
    jax_implementation: str,
):
    """jax.nn.dot_product_attention with the mask expressed as sequence lengths.

    Only unpacked rows get here (segment_aware=False): one document from index 0, so
    positions equal the index and the segment mask reduces to per-row lengths. Registered
    with jax_implementation='cudnn'; tests run it with 'xla' to check this translation.
    """
    del q_positions_BT, kv_positions_BS, out_sharding  # the dispatcher restores the layout
    q_len_B = jnp.sum(q_segment_ids_BT != 0, axis=1, dtype=jnp.int32)
    kv_len_B = jnp.sum(kv_segment_ids_BS != 0, axis=1, dtype=jnp.int32)
    window = None
    if sliding_window is not None and sliding_window > 0:
        # jax's (left, right) counts tokens besides the query: w visible = w - 1 to the left.
        window = (sliding_window - 1, 0)
    return jax.nn.dot_product_attention(
        q_BTND,
        k_BSKD,
        v_BSKD,
        scale=scale,
        is_causal=causal,
        query_seq_lengths=q_len_B,
        key_value_seq_lengths=kv_len_B,
        local_window_size=window,
        implementation=jax_implementation,
    )


def _segment_unaware_limit(q_BTND, k_BSKD, packed, causal, sliding_window) -> str | None:
    """Why a segment-unaware backend cannot compute this call exactly, or None."""
    if packed:
        return (
            "cannot honour document boundaries in packed rows (the public cuDNN path takes "
            "sequence lengths, not segment ids; pass packed=False for one document per row)"
        )
    if q_BTND.shape[1] != k_BSKD.shape[1]:
        return "needs T == S (its causal mask counts from index 0 of both; KV-cache decoding)"
    if not _is_static(sliding_window):
        return "needs a static sliding window (this one is traced, e.g. per stacked layer)"
    if sliding_window is not None and sliding_window > 0 and not causal:
        return "supports a sliding window only with causal masking"
    return None


def _warn_once(name: str, reason: str) -> None:
    if (name, reason) in _WARNED:
        return
    _WARNED.add((name, reason))
    warnings.warn(
        f"attention implementation {name!r} {reason}; falling back to 'xla' for this call",
        stacklevel=3,
    )


def _check_shapes(q, k, v, q_seg, kv_seg, q_pos, kv_pos) -> None:
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape:
        raise ValueError(
            f"attention wants q [B, T, N, D] and k, v [B, S, K, D] of one shape; got "
            f"q {q.shape}, k {k.shape}, v {v.shape}"
        )
    B, T, N, D = q.shape
    Bk, S, K, Dk = k.shape
    if Bk != B or Dk != D or N % K:
        raise ValueError(
            f"q {q.shape} and k {k.shape} disagree: same B and D needed, and K must divide N"
        )
    for name, x, want in (
        ("q_segment_ids_BT", q_seg, (B, T)),
        ("q_positions_BT", q_pos, (B, T)),
        ("kv_segment_ids_BS", kv_seg, (B, S)),
        ("kv_positions_BS", kv_pos, (B, S)),
    ):
        if tuple(x.shape) != want:
            raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {want}")


register_backend("xla", _xla_attention, keeps_layout=True, segment_aware=True)
register_backend(
    "cudnn",
    functools.partial(_public_path, jax_implementation="cudnn"),
    keeps_layout=False,
    segment_aware=False,
    unavailable=_cudnn_unavailable,
)
