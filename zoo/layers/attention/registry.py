"""The attention backends by name, and which one a call runs on.

Backends register here (`register_backend`; the xla, splash and cudnn modules do so on
import), tests swap one in for a block (`override_backend`), and entry points ask up front
whether a backend named in a config can run on a platform (`check_implementation`). `auto`
is splash on TPU, cudnn on GPU, xla elsewhere. A backend asked for by name is a promise: where
it cannot run, `UsageError` says why; it is never swapped for another.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp

from nnx_zoo.errors import UsageError

# What `auto` runs on each platform (where it can; else xla).
_AUTO = {"tpu": "splash", "gpu": "cudnn", "cuda": "cudnn"}


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
    # True: takes `sinks=` ([N] attention-sink logits, GPT-OSS) beside its other arguments.
    sinks: bool = False


_BACKENDS: dict[str, AttentionBackend] = {}


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
    sinks: bool = False,
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
        sinks=sinks,
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


def backend(name: str) -> AttentionBackend:
    """The registered backend `name` (KeyError for one that is not)."""
    return _BACKENDS[name]


def backend_names() -> tuple[str, ...]:
    return tuple(sorted(_BACKENDS))


def _why_unavailable(backend: AttentionBackend, call: CallInfo) -> str | None:
    return None if backend.unavailable is None else backend.unavailable(call)


def auto_choice(call: CallInfo) -> tuple[str, str]:
    """(backend, why) `auto` runs a call on by what it is known to ask (dtype, head dim,
    lengths, platform): the platform's flash backend where it can run, else xla."""
    pick = _AUTO.get(call.platform)
    if pick is None or pick not in _BACKENDS:
        return "xla", f"auto: no flash backend for {call.platform}"
    reason = _why_unavailable(_BACKENDS[pick], dataclasses.replace(call, auto=True))
    if reason is not None:
        return "xla", f"auto: {pick} {reason}"
    return pick, f"auto: {pick} on {call.platform}"


def named_backend(name: str) -> AttentionBackend:
    """The backend registered as `name`; UsageError naming the valid ones when none is."""
    if name not in _BACKENDS:
        valid = ", ".join((*backend_names(), "auto"))
        raise UsageError(f"unknown attention implementation {name!r}; valid: {valid}")
    return _BACKENDS[name]


def resolve_implementation(name: str, call: CallInfo) -> str:
    """The registered backend that `name` runs on; pure, so every platform's branch is
    testable on CPU. 'auto': the platform's flash backend where it can run this call, else
    'xla'. A backend asked for by name that cannot run here raises UsageError saying why."""
    if name == "auto":
        return auto_choice(call)[0]
    reason = _why_unavailable(named_backend(name), call)
    if reason is not None:
        raise UsageError(f"attention implementation {name!r} {reason}; use 'xla' or 'auto'")
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
    UsageError with one line saying why it cannot and what would."""
    call = CallInfo(
        dtype=jnp.dtype(dtype),
        head_dim=head_dim,
        q_len=seq_len,
        kv_len=seq_len,
        platform=platform or jax.default_backend(),
        interpret=interpret,
    )
    return resolve_implementation(name, call)
