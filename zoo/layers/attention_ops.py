"""The attention function every family calls, with pluggable backends (xla, splash, cudnn).

Dims: B batch, T query positions, S key/value positions, N query heads, K key/value heads,
G = N // K query heads per kv head (MHA G=1, GQA, MQA K=1), D head dim.

Masking is by segment ids and positions (`attention_mask.Segments`, and the rule in
zoo/layers/attention_mask.py), which serves packed training rows and KV caches alike.

Backends, in a registry (`register_backend`, `override_backend`):

| name   | where                 | how                                                      |
|--------|-----------------------|----------------------------------------------------------|
| xla    | everywhere            | einsums with every layout declared; [B, N, T, S] scores  |
| splash | TPU (CPU: interpret)  | Pallas splash kernel, segment ids, index masks           |
| cudnn  | NVIDIA GPU, bf16/fp16 | cuDNN fused attention: lengths (unpacked) / mask (packed) |

`auto` is splash on TPU, cudnn on GPU, xla elsewhere. Each backend declares what it can do
(`AttentionBackend`): whether its output keeps the declared layout under an explicit mesh
(else the dispatcher runs it per device inside shard_map, `_per_shard`), whether it keeps
documents of packed rows apart, whether it needs T == S (index-based masks: a KV-cache decode
step has T != S) and whether it needs a window known at trace time (a per-layer window of
stacked layers is traced). A call a backend cannot express goes to xla, and the reason is
logged once (a warning when the backend was named explicitly). A backend named explicitly
that cannot run at all here (platform, dtype, head dim, length) raises ValueError saying why,
at trace time, before any compile; `check_implementation` asks the same question up front.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from zoo.layers import attention_cudnn, attention_splash
from zoo.layers.attention_mask import Segments, attention_mask, is_static
from zoo.layers.config import ATTENTION_IMPLEMENTATIONS as IMPLEMENTATIONS

__all__ = [
    "IMPLEMENTATIONS",
    "AttentionBackend",
    "CallInfo",
    "Segments",
    "attention",
    "attention_mask",
    "backend_names",
    "check_implementation",
    "override_backend",
    "register_backend",
    "resolve_implementation",
]

# What `auto` runs on each platform (where it can; else xla).
_AUTO = {"tpu": "splash", "gpu": "cudnn", "cuda": "cudnn"}

# Where a mask excludes a logit. Finite, not -inf: a row with nothing visible then softmaxes
# to a uniform average instead of NaN, and its gradient stays finite.
_MASKED_LOGIT = float(np.finfo(np.float32).min)

_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CallInfo:
    """What a backend is asked to run, as known at trace time (or from a config up front)."""

    dtype: Any
    head_dim: int
    q_len: int
    kv_len: int
    platform: str  # the platform the program is compiled for: 'cpu' | 'tpu' | 'gpu' | 'cuda'
    interpret: bool = False  # Pallas kernels may run in interpret mode (CPU tests)
    auto: bool = False  # chosen by 'auto' (conservative limits) rather than by name


# A backend: fn(q_BTND, k_BSKD, v_BSKD, segments, *, scale, causal, sliding_window,
# out_sharding, interpret) -> out_BTND.
BackendFn = Callable[..., jax.Array]
# Why a backend cannot run a call here at all, or None.
UnavailableFn = Callable[[CallInfo], "str | None"]


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    name: str
    fn: BackendFn
    # True: under an explicit mesh the output (and the gradients of q, k, v) are already
    # typed with their layouts (the backend builds them with out_sharding-aware ops).
    # False: a black box to sharding types (custom calls: cuDNN, Pallas); the dispatcher runs
    # it per device inside jax.shard_map and reshards the result to `out_sharding`.
    keeps_layout: bool
    # True: keeps documents of packed rows apart (segment ids). False: only gets unpacked
    # rows (Segments.packed=False: one document from index 0, then padding).
    packed_rows: bool = True
    # True: masks by index, so only T == S (no KV-cache decode step).
    equal_lengths: bool = False
    # True: needs the window as a Python int (not the traced per-layer value under a scan).
    static_window: bool = False
    unavailable: UnavailableFn | None = None


_BACKENDS: dict[str, AttentionBackend] = {}
_LOGGED: set[tuple[str, str]] = set()


def register_backend(
    name: str,
    fn: BackendFn,
    *,
    keeps_layout: bool,
    packed_rows: bool = True,
    equal_lengths: bool = False,
    static_window: bool = False,
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
        packed_rows=packed_rows,
        equal_lengths=equal_lengths,
        static_window=static_window,
        unavailable=unavailable,
    )
    _BACKENDS[name] = backend
    return backend


@contextlib.contextmanager
def override_backend(name: str, fn: BackendFn, **flags) -> Iterator[AttentionBackend]:
    """Registers `fn` as `name` (available on every platform) for the `with` block only.

    For tests: e.g. a stand-in for 'cudnn' that drops the layout, as the cuDNN call does,
    reached through a model whose config only names 'xla' / 'cudnn' / 'splash' / 'auto'.
    """
    previous = _BACKENDS.get(name)
    try:
        yield register_backend(name, fn, replace=True, **flags)
    finally:
        if previous is None:
            _BACKENDS.pop(name, None)
        else:
            _BACKENDS[name] = previous


def backend_names() -> tuple[str, ...]:
    return tuple(sorted(_BACKENDS))


def _why_unavailable(backend: AttentionBackend, call: CallInfo) -> str | None:
    return None if backend.unavailable is None else backend.unavailable(call)


def resolve_implementation(name: str, call: CallInfo) -> str:
    """The registered backend that `name` runs on; pure, so every platform's branch is
    testable on CPU. 'auto': the platform's flash backend where it can run this call, else
    'xla'. A backend asked for by name that cannot run here raises ValueError saying why."""
    if name == "auto":
        pick = _AUTO.get(call.platform)
        backend = _BACKENDS.get(pick) if pick else None
        auto_call = dataclasses.replace(call, auto=True)
        if backend is not None and _why_unavailable(backend, auto_call) is None:
            return pick
        return "xla"
    if name not in _BACKENDS:
        valid = ", ".join((*backend_names(), "auto"))
        raise ValueError(f"unknown attention implementation {name!r}; valid: {valid}")
    reason = _why_unavailable(_BACKENDS[name], call)
    if reason is not None:
        raise ValueError(f"attention implementation {name!r} {reason}; use 'xla' or 'auto'")
    return name


def check_implementation(
    name: str,
    *,
    dtype,
    head_dim: int,
    seq_len: int,
    platform: str | None = None,
    interpret: bool = False,
) -> str:
    """For entry points, before building anything: the backend `name` will run for a model
    of this dtype / head dim / sequence length on `platform` (default: this process's), or
    ValueError with one line saying why it cannot and what would."""
    call = CallInfo(
        dtype=jnp.dtype(dtype),
        head_dim=head_dim,
        q_len=seq_len,
        kv_len=seq_len,
        platform=platform or jax.default_backend(),
        interpret=interpret,
    )
    return resolve_implementation(name, call)


def compile_platform() -> str:
    """The platform the current trace compiles for: the mesh's devices when a mesh is set
    (an abstract TPU / GPU target on a CPU host), else this process's default backend."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else getattr(mesh, "abstract_device", None)
    platform = getattr(device, "platform", None)
    return platform or jax.default_backend()


def attention(
    q_BTND: jax.Array,
    k_BSKD: jax.Array,
    v_BSKD: jax.Array,
    segments: Segments,
    *,
    scale: float,
    out_sharding: P | None,
    causal: bool = True,
    sliding_window: int | jax.Array | None = None,
    implementation: str = "xla",
    interpret: bool = False,
) -> jax.Array:
    """Softmax attention of q over k/v under the segment/position mask; out_BTND, q's dtype.

    segments: ids and positions of queries and keys, and whether rows are packed.
    sliding_window: None, a Python int, or a (traced) int32 scalar -- e.g. the per-layer
      value of layers stacked under nnx.scan; a value <= 0 means no window.
    out_sharding: the declared layout of the output (None: q's layout).
    interpret: let Pallas backends run in interpret mode (on CPU; tests and debugging).
    """
    _check_shapes(q_BTND, k_BSKD, v_BSKD, segments)
    call = CallInfo(
        dtype=q_BTND.dtype,
        head_dim=q_BTND.shape[-1],
        q_len=q_BTND.shape[1],
        kv_len=k_BSKD.shape[1],
        platform=compile_platform(),
        interpret=interpret,
    )
    # What this call asks that a backend's masks cannot say (a decode step, a traced window,
    # packed rows for a lengths-only backend) is checked before whether the backend can run
    # here at all: a decode step of a splash model goes to xla rather than fail on its T.
    name = implementation if implementation in _BACKENDS else None
    if name is None:
        name = resolve_implementation(implementation, call)
    reason = _cannot_express(_BACKENDS[name], q_BTND, k_BSKD, segments, sliding_window)
    if reason is None:
        name = resolve_implementation(implementation, call)
        reason = _cannot_express(_BACKENDS[name], q_BTND, k_BSKD, segments, sliding_window)
    if reason is not None:
        _log_once(name, reason, explicit=implementation != "auto")
        name = "xla"
    backend = _BACKENDS[name]

    options = dict(scale=scale, causal=causal, interpret=interpret)
    if backend.keeps_layout or not _explicit_axes():
        out_BTND = backend.fn(
            q_BTND,
            k_BSKD,
            v_BSKD,
            segments,
            sliding_window=sliding_window,
            out_sharding=out_sharding,
            **options,
        )
    else:
        out_BTND = _per_shard(
            backend.fn, q_BTND, k_BSKD, v_BSKD, segments, sliding_window, **options
        )
        if out_sharding is not None:
            out_BTND = _reshard_to(out_BTND, out_sharding)
    return out_BTND.astype(q_BTND.dtype)


def _cannot_express(backend, q_BTND, k_BSKD, segments, sliding_window) -> str | None:
    """Why `backend` cannot compute this particular call exactly, or None."""
    if segments.packed and not backend.packed_rows:
        return (
            "cannot keep the documents of packed rows apart (it takes sequence lengths, not "
            "segment ids; Segments.packed=False states one document per row)"
        )
    if backend.equal_lengths and q_BTND.shape[1] != k_BSKD.shape[1]:
        return (
            "masks by index and needs T == S (a KV-cache decode step has "
            f"T={q_BTND.shape[1]}, S={k_BSKD.shape[1]})"
        )
    if backend.static_window and not is_static(sliding_window):
        return (
            "needs a sliding window known at trace time (this one is traced: layers stacked "
            "under a scan with different windows)"
        )
    return None


def _log_once(name: str, reason: str, *, explicit: bool) -> None:
    if (name, reason) in _LOGGED:
        return
    _LOGGED.add((name, reason))
    message = f"attention implementation {name!r} {reason}; this call runs on 'xla'"
    if explicit:
        warnings.warn(message, stacklevel=3)
    _log.warning(message)


def _per_shard(fn: BackendFn, q_BTND, k_BSKD, v_BSKD, segments, sliding_window, **options):
    """The layout fix: run a black-box backend inside jax.shard_map over batch and heads.

    A custom call's abstract values carry no sharding outside shard_map: the cuDNN call's
    output *and* the q/k/v gradients of its custom_vjp come back typed unsharded, although q,
    k, v were `B/data T N/model D`. Forward, an out-projection that names its output layout
    then silently all-gathers the whole attention output onto every device; one that does not
    (fsdp_tp kernel `N/model D M/data`) returns `B T M/data`, and the next op that meets a
    declared layout fails at trace time with a ShardingTypeError (`dot_general requires
    contracting dimensions to have consistent sharding, got ('data',) and ('model',)`, or
    `add got incompatible shardings` at the residual). `jax.sharding.reshard(out, spec)`
    after the call fixes only the forward. Backward, jax rejects the unsharded gradients
    against the sharded primal inputs (`Custom VJP bwd rule must produce an output with the
    same type as the args tuple of the primal function`), which no reshard after the call can
    reach. Inside shard_map every device runs the call on its own `B/data`, `N/model` block (a
    plain local attention: heads and batch rows are independent), types are per-device and
    consistent in both directions, and out_specs gives the result its layout back. Pallas
    kernels (splash) are the same kind of black box, and need `check_vma=False` there.

    Sequence dims are gathered: the kernels mask by index, which would be wrong on a block of
    queries. Heads split as the xla path splits them (`_plan_layout`), so each device holds
    the kv heads of its query heads.
    """
    lay = _plan_layout(q_BTND, k_BSKD, split_queries=False)
    args = [
        _reshard_to(q_BTND, lay.q),
        _reshard_to(k_BSKD, lay.kv),
        _reshard_to(v_BSKD, lay.kv),
        _reshard_segments(segments, lay),
    ]
    specs = [
        lay.q,
        lay.kv,
        lay.kv,
        Segments(lay.q_tokens, lay.kv_tokens, lay.q_tokens, lay.kv_tokens, segments.packed),
    ]
    static = is_static(sliding_window)
    if not static:  # a traced per-layer window enters as an argument, replicated
        args.append(jnp.asarray(sliding_window, jnp.int32))
        specs.append(P())

    def local(q, k, v, segs, *window):
        return fn(
            q,
            k,
            v,
            segs,
            sliding_window=sliding_window if static else window[0],
            out_sharding=None,  # no explicit axes inside: layouts are shard_map's
            **options,
        )

    return jax.shard_map(local, in_specs=tuple(specs), out_specs=lay.out, check_vma=False)(*args)


def _reshard_segments(segments: Segments, lay) -> Segments:
    return Segments(
        _reshard_to(segments.q_ids_BT, lay.q_tokens),
        _reshard_to(segments.kv_ids_BS, lay.kv_tokens),
        _reshard_to(segments.q_positions_BT, lay.q_tokens),
        _reshard_to(segments.kv_positions_BS, lay.kv_tokens),
        segments.packed,
    )


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


# Causal self-attention on the XLA path runs in query blocks, each against the keys up to its
# end (and from its window's start): the blocks above the diagonal, all masked, are never
# computed. With n blocks that is (n + 1) / 2n of the logits (62% at n = 4, 56% at n = 8),
# and of the memory traffic of the mask, softmax and transposes around them, which on CPU
# cost about as much as the two matmuls (bench/vs_transformers.py: +16% train, +25% forward
# tokens/s on the `small` model at T = 512). Blocks of at least this many queries, at most
# this many blocks (each block is its own matmuls in the compiled program):
_MIN_QUERY_BLOCK = 128
_MAX_QUERY_BLOCKS = 8


def _causal_blocks(T: int, S: int, causal: bool, sliding_window, self_attention: bool, lay):
    """[(t0, t1, s0, s1)]: query rows t0:t1 attend key rows s0:s1; None for one block.

    Exact where key index order is position order within a document (the Segments
    convention): a key after the query's index is then later in its document or in another
    one, masked either way; so is a key more than the window before the block. Only a
    padding query (segment 0, which the loss ignores) may see fewer padding keys.
    """
    if not causal or not self_attention or T != S or T % _MIN_QUERY_BLOCK:
        return None
    if lay is not None and tuple(lay.q)[1] is not None:  # T split (context parallelism)
        return None
    n = min(_MAX_QUERY_BLOCKS, T // _MIN_QUERY_BLOCK)
    while T % n:
        n -= 1
    if n < 2:
        return None
    size = T // n
    window = sliding_window if is_static(sliding_window) and sliding_window else None
    blocks = []
    for t0 in range(0, T, size):
        s0 = 0 if window is None else max(0, (t0 - window + 1) // size * size)
        blocks.append((t0, t0 + size, s0, t0 + size))
    return blocks


def _xla_attention(
    q_BTND,
    k_BSKD,
    v_BSKD,
    segments: Segments,
    *,
    scale,
    causal,
    sliding_window,
    out_sharding,
    interpret: bool = False,
):
    del interpret
    # Before any reshard: the same ids array for queries and keys is self-attention.
    self_attention = segments.q_ids_BT is segments.kv_ids_BS
    B, T, N, D = q_BTND.shape
    K = k_BSKD.shape[2]
    G = N // K
    lay = _plan_layout(q_BTND, k_BSKD)
    if lay is not None:
        q_BTND = _reshard_to(q_BTND, lay.q)
        k_BSKD = _reshard_to(k_BSKD, lay.kv)
        v_BSKD = _reshard_to(v_BSKD, lay.kv)
        segments = _reshard_segments(segments, lay)

    def spec(name):
        return None if lay is None else getattr(lay, name)

    mask_BTS = attention_mask(segments, causal=causal, sliding_window=sliding_window)
    q_BTKGD = jnp.reshape(q_BTND, (B, T, K, G, D), out_sharding=spec("grouped"))

    blocks = _causal_blocks(T, k_BSKD.shape[1], causal, sliding_window, self_attention, lay)
    if self_attention:
        out_BTKGD = _heads_major(q_BTKGD, k_BSKD, v_BSKD, mask_BTS, blocks, scale, lay)
    else:
        out_BTKGD = _attend(
            "BTKGD,BSKD->BKGTS",
            "BKGTS,BSKD->BTKGD",
            q_BTKGD,
            k_BSKD,
            v_BSKD,
            mask_BTS[:, None, None],
            scale,
            spec("logits"),
            spec("grouped"),
        )
    out_BTND = jnp.reshape(out_BTKGD, (B, T, N, D), out_sharding=spec("out"))
    out_BTND = out_BTND.astype(q_BTND.dtype)
    if lay is not None and out_sharding is not None:
        # The output comes out in q's (possibly head-gathered) layout; reshard only when the
        # declared one differs, so the usual case (declared == q's) adds nothing.
        out_BTND = _reshard_to(out_BTND, out_sharding)
    return out_BTND


def _attend(logits_eq, out_eq, q, k, v, mask, scale, logits_spec, out_spec):
    """softmax(mask(q.k * scale)).v with the two einsums given; `mask` broadcasts to the logits.

    Logits, softmax and the weighted sum accumulate in float32 whatever the input dtype (as
    jax.nn.dot_product_attention and the cuDNN kernel do); probabilities are cast back to
    v's dtype for the second matmul.
    """
    logits = jnp.einsum(
        logits_eq, q, k, preferred_element_type=jnp.float32, out_sharding=logits_spec
    )
    logits = jnp.where(mask, logits * scale, _MASKED_LOGIT)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    return jnp.einsum(out_eq, probs, v, preferred_element_type=jnp.float32, out_sharding=out_spec)


def _heads_major(q_BTKGD, k_BSKD, v_BSKD, mask_BTS, blocks, scale, lay):
    """Self-attention with heads ahead of positions: logits [B, K, T, G, S], S minor.

    The [T, D]-sized q, k and v are transposed once so each (b, k) pair is a plain
    row-major [T*G, D] x [D, S] and [T*G, S] x [S, D] matmul: the [T, S]-sized logits and
    probabilities, which the token-major einsums made XLA CPU transpose before and after
    each matmul, are then written and read once each in the order they are stored. At the
    `small` model's shape (4x512, CPU) this halves the attention forward and cuts forward +
    backward by about a fifth; the 3.4M model of bench/vs_transformers.py trains ~20% faster.
    KV-cache calls (T != S) keep the token-major path: there it would transpose the cache.
    """
    qb, qt, kv_heads, group = (None,) * 4 if lay is None else tuple(lay.grouped)[:4]
    grouped = None if lay is None else P(qb, kv_heads, qt, group, None)
    q_BKTGD = jnp.transpose(q_BTKGD, (0, 2, 1, 3, 4))
    k_BKSD = jnp.transpose(k_BSKD, (0, 2, 1, 3))
    v_BKSD = jnp.transpose(v_BSKD, (0, 2, 1, 3))

    def one(q_BKTGD, k_BKSD, v_BKSD, mask_BTS):
        return _attend(
            "BKTGD,BKSD->BKTGS",
            "BKTGS,BKSD->BKTGD",
            q_BKTGD,
            k_BKSD,
            v_BKSD,
            mask_BTS[:, None, :, None],
            scale,
            grouped,
            grouped,
        )

    if blocks is None:
        out_BKTGD = one(q_BKTGD, k_BKSD, v_BKSD, mask_BTS)
    else:
        outs = [
            one(
                q_BKTGD[:, :, t0:t1],
                k_BKSD[:, :, s0:s1],
                v_BKSD[:, :, s0:s1],
                mask_BTS[:, t0:t1, s0:s1],
            )
            for t0, t1, s0, s1 in blocks
        ]
        out_BKTGD = jnp.concatenate(outs, axis=2)
    return jnp.transpose(out_BKTGD, (0, 2, 1, 3, 4))


def _check_shapes(q, k, v, segments: Segments) -> None:
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
        ("q_ids_BT", segments.q_ids_BT, (B, T)),
        ("q_positions_BT", segments.q_positions_BT, (B, T)),
        ("kv_ids_BS", segments.kv_ids_BS, (B, S)),
        ("kv_positions_BS", segments.kv_positions_BS, (B, S)),
    ):
        if tuple(x.shape) != want:
            raise ValueError(f"segments.{name} has shape {tuple(x.shape)}, expected {want}")


register_backend("xla", _xla_attention, keeps_layout=True)
register_backend(
    "splash",
    attention_splash.splash_attention,
    keeps_layout=False,
    equal_lengths=True,
    static_window=True,
    unavailable=attention_splash.unavailable,
)
register_backend(
    "cudnn",
    attention_cudnn.cudnn_attention,
    keeps_layout=False,
    equal_lengths=True,
    unavailable=attention_cudnn.unavailable,
)
