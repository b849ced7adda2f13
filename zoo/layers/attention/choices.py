"""Which backend each attention call site runs on, and why: what `auto` chose, for the record.

The dispatcher (and the context-parallel ring, which picks its blocks' kernel) reports every
call it traces here. Inside `recording()` the reports are kept: train_main traces the step
under it and writes them to run_info.json's `attention`, eval_main to eval.json's. A call site
is described by what decides its backend -- its kind (self-attention, a KV-cache step, a
context-parallel block), T and S, heads, head dim, dtype, mask -- so the layers of a stack
that make the same call share one entry. Only calls traced inside the block are seen: a
function jax has already traced for the same types is not traced again.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator

import jax.numpy as jnp

from nnx_zoo.errors import UsageError
from zoo.layers.attention.mask import Segments, is_static, static_window


@dataclasses.dataclass(frozen=True)
class Choice:
    call: str  # the call site (`describe_call`)
    asked: str  # the implementation the config names: a backend, or 'auto'
    backend: str  # the backend the call runs on
    why: str  # 'asked for by name', or why `auto` chose it


# `why` of a backend the config names (only `auto` chooses).
NAMED = "asked for by name"

_RECORDING: contextvars.ContextVar[list[Choice] | None] = contextvars.ContextVar(
    "attention_choices", default=None
)


@contextlib.contextmanager
def recording() -> Iterator[list[Choice]]:
    """Collect the choices of the attention calls traced inside the block (in the order they
    were first made, each distinct one once)."""
    kept: list[Choice] = []
    token = _RECORDING.set(kept)
    try:
        yield kept
    finally:
        _RECORDING.reset(token)


def record(choice: Choice) -> None:
    kept = _RECORDING.get()
    if kept is not None and choice not in kept:
        kept.append(choice)


def refusal(name: str, call: str, reason: str) -> UsageError:
    """The error for a backend asked for by name that cannot run `call`: it is not swapped
    for another (only `auto` chooses)."""
    return UsageError(
        f"attention implementation {name!r} cannot run a call this model makes ({call}): it "
        f"{reason}; use attention_impl 'auto' (it runs such calls on xla) or 'xla'"
    )


def to_json(choices: list[Choice]) -> dict:
    """run_info.json's / eval.json's `attention`: the implementation asked for and, per call
    site, the backend it runs on and why."""
    asked = sorted({c.asked for c in choices})
    return {
        "implementation": asked[0] if len(asked) == 1 else (asked or None),
        "calls": [{"call": c.call, "backend": c.backend, "why": c.why} for c in choices],
    }


def describe_call(
    q_BTND, k_BSKD, segments: Segments, *, causal: bool, sliding_window, site: str | None
) -> str:
    """One line naming the call: e.g. 'causal self-attention: T=S=2048, 32/8 heads x 128,
    bfloat16, packed rows, no window'."""
    _, T, N, D = q_BTND.shape
    S, K = k_BSKD.shape[1], k_BSKD.shape[2]
    kind = site or ("self-attention" if segments.q_ids_BT is segments.kv_ids_BS else "attention")
    lengths = f"T=S={T}" if T == S else f"T={T}, S={S}"
    rows = "packed rows" if segments.packed else "one document per row"
    if not is_static(sliding_window):
        window = "per-layer window (traced)"
    elif static_window(sliding_window) is None:
        window = "no window"
    else:
        window = f"window {static_window(sliding_window)}"
    return (
        f"{'causal' if causal else 'bidirectional'} {kind}: {lengths}, {N}/{K} heads x {D}, "
        f"{jnp.dtype(q_BTND.dtype).name}, {rows}, {window}"
    )
