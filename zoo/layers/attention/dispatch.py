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
(else the dispatcher runs it per device inside shard_map, `per_shard`), whether it keeps
documents of packed rows apart, whether it needs T == S (index-based masks: a KV-cache decode
step has T != S) and whether it needs a window known at trace time (a per-layer window of
stacked layers is traced).

Only `auto` chooses: it runs a call its platform's backend cannot express (or cannot run at
all: dtype, head dim, length) on xla. A backend named explicitly is a promise: a call it
cannot express or run raises `UsageError` at trace time, before any compile, naming the
backend, the call and why. Every call's choice is reported to `choices` (run_info.json
records them); `check_implementation` asks the platform question up front.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from shardings.mesh import compile_platform

# The backends register themselves on import.
from zoo.layers.attention import cudnn, splash, xla  # noqa: F401
from zoo.layers.attention.choices import NAMED, Choice, describe_call, record, refusal
from zoo.layers.attention.layout import explicit_axes, per_shard, reshard_to
from zoo.layers.attention.mask import Segments, is_static
from zoo.layers.attention.registry import (
    _AUTO,
    _BACKENDS,
    CallInfo,
    _why_unavailable,
    auto_choice,
    named_backend,
)


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
    site: str | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Softmax attention of q over k/v under the segment/position mask; out_BTND, q's dtype.

    segments: ids and positions of queries and keys, and whether rows are packed.
    sliding_window: None, a Python int, or a (traced) int32 scalar -- e.g. the per-layer
      value of layers stacked under nnx.scan; a value <= 0 means no window.
    out_sharding: the declared layout of the output (None: q's layout).
    interpret: let Pallas backends run in interpret mode (on CPU; tests and debugging).
    site: what kind of call this is, for the record and errors (default: self-attention when
      queries and keys share their segment ids, else attention).
    sinks: None, or [N] attention-sink logits (GPT-OSS): one more logit per query head in
      every softmax denominator, with no value; only backends registered with `sinks=True`
      take them (`auto` runs such a call on one that does).
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
    what = describe_call(
        q_BTND, k_BSKD, segments, causal=causal, sliding_window=sliding_window, site=site
    )
    if sinks is not None:
        what += ", attention sinks"
    has_sinks = sinks is not None
    if implementation == "auto":
        name, why = _auto(call, q_BTND, k_BSKD, segments, sliding_window, has_sinks)
    else:
        backend = named_backend(implementation)
        # What the call asks that the masks cannot say comes first: it is the reason that
        # holds on every platform.
        reason = _cannot_express(backend, q_BTND, k_BSKD, segments, sliding_window, has_sinks)
        reason = reason or _why_unavailable(backend, call)
        if reason is not None:
            raise refusal(implementation, what, reason)
        name, why = implementation, NAMED
    record(Choice(what, implementation, name, why))
    backend = _BACKENDS[name]

    options = dict(scale=scale, causal=causal, interpret=interpret)
    if sinks is not None:
        options["sinks"] = sinks
    if backend.keeps_layout or not explicit_axes():
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
        out_BTND = per_shard(
            backend.fn, q_BTND, k_BSKD, v_BSKD, segments, sliding_window, **options
        )
        if out_sharding is not None:
            out_BTND = reshard_to(out_BTND, out_sharding)
    return out_BTND.astype(q_BTND.dtype)


def _cannot_express(
    backend, q_BTND, k_BSKD, segments, sliding_window, has_sinks=False
) -> str | None:
    """Why `backend` cannot compute this particular call exactly, or None."""
    if has_sinks and not backend.sinks:
        return "takes no attention-sink logits (GPT-OSS's per-head extra softmax term)"
    if segments.packed and not backend.packed_rows:
        return (
            "cannot keep the documents of packed rows apart (it takes sequence lengths, not "
            "segment ids; Segments.packed=False states one document per row)"
        )
    if backend.equal_lengths and q_BTND.shape[1] != k_BSKD.shape[1]:
        return (
            f"masks by index and needs T == S (query t and key t at one position), got "
            f"T={q_BTND.shape[1]}, S={k_BSKD.shape[1]}"
        )
    if backend.static_window and not is_static(sliding_window):
        return (
            "needs a sliding window known at trace time (this one is traced: layers stacked "
            "under a scan with different windows)"
        )
    return None


def _auto(
    call: CallInfo, q_BTND, k_BSKD, segments, sliding_window, has_sinks=False
) -> tuple[str, str]:
    """(backend, why): the platform's flash backend where it can express and run this call,
    else xla. What the call asks that the backend's masks cannot say (a decode step, a traced
    window) is the reason given before whether it can run here at all: a decode step of a TPU
    model is 'needs T == S', not 'needs lengths that are multiples of 128'."""
    pick = _AUTO.get(call.platform)
    if pick in _BACKENDS:
        reason = _cannot_express(
            _BACKENDS[pick], q_BTND, k_BSKD, segments, sliding_window, has_sinks
        )
        if reason is not None:
            return "xla", f"auto: {pick} {reason}"
    return auto_choice(call)


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
