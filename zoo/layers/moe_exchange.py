"""Expert parallelism: how one device's routed rows reach the devices of their experts and back.

Runs inside `jax.shard_map`. Each device holds its tokens' assignments sorted by global expert
id (`x_XM`, X = tokens x k rows, `counts_E` per expert) and E/e whole experts (e = the expert
axis's size); the rows for expert shard j are one contiguous run of the sorted order. Two ways
to move them, chosen by `DecoderConfig.moe_exchange`:

- `ragged` (`jax.lax.ragged_all_to_all`): each device sends exactly its routed rows, X x M per
  exchange whatever the routing, and receives them into a buffer of e*X rows (room for every
  shard sending it everything, so it is dropless). The combine sends the computed rows back
  the same way. XLA lowers it on TPU and GPU; XLA:CPU (jax 0.10.2) does not ("HLO opcode
  `ragged-all-to-all` is not supported by XLA:CPU ThunkEmitter").
- `padded` (`jax.lax.all_to_all` of [e, C, M] buffers, C rows per destination shard): what CPU
  runs. C = ceil(moe_capacity_factor x X / e), at most X; 0 (the default) means C = X, room for
  the worst case, so nothing is dropped at the price of e times the ragged exchange's bytes. A
  smaller C drops the rows past C of each destination (Switch / GShard: those assignments add
  nothing to their token's output), and the count of dropped assignments comes back.

`override_ragged_all_to_all(fn)` swaps in another implementation of `ragged_all_to_all` for a
block: the tests' emulation from dense all_to_alls (tests/ragged_emulation.py), so that the
ragged path's offset arithmetic runs and is tested on CPU.
"""

from __future__ import annotations

import contextlib
import math

import jax
import jax.numpy as jnp

from nnx_zoo.errors import UsageError

EXCHANGES = ("auto", "ragged", "padded")

# The ragged_all_to_all the exchange calls (None: jax.lax's), and rows per packet (0: as
# `packet_rows()` says), while `override_ragged_all_to_all` is in force.
_RAGGED = {"override": None, "packet_rows": 0}


@contextlib.contextmanager
def override_ragged_all_to_all(fn, packet_rows: int = 0):
    """Inside the block, the ragged exchange calls `fn` (`jax.lax.ragged_all_to_all`'s
    arguments) in its place, on any backend, sending `packet_rows` rows per unit when given."""
    before = dict(_RAGGED)
    _RAGGED.update(override=fn, packet_rows=packet_rows)
    try:
        yield
    finally:
        _RAGGED.update(before)


def resolve_exchange(name: str, platform: str) -> str:
    """'auto' -> 'ragged' where XLA lowers ragged_all_to_all (TPU, GPU), else 'padded'.
    An explicit 'ragged' where it cannot lower raises UsageError (one line)."""
    if name not in EXCHANGES:
        raise UsageError(f"moe_exchange={name!r}; valid: {', '.join(EXCHANGES)}")
    lowers = platform != "cpu" or _RAGGED["override"] is not None
    if name == "auto":
        return "ragged" if lowers else "padded"
    if name == "ragged" and not lowers:
        raise UsageError(
            f"moe_exchange='ragged' needs a TPU or GPU (XLA:{platform.upper()} cannot lower "
            "ragged_all_to_all); valid here: auto, padded"
        )
    return name


def _exclusive_cumsum(x, axis=0):
    return jnp.cumsum(x, axis=axis) - x


def _ragged_all_to_all(*args, axis_name):
    if _RAGGED["override"] is not None:
        return _RAGGED["override"](*args, axis_name=axis_name)
    return jax.lax.ragged_all_to_all(*args, axis_name=axis_name)


def _group_and_compute(rows_RM, runs_sL, compute):
    """Rows arriving as one block per source s, each holding runs of `runs_sL[s, :-1]` rows per
    local expert then `runs_sL[s, -1]` padding rows (rows past all blocks are padding too)
    -> `compute(rows sorted by local expert, group sizes)`, back in arrival order (padding
    rows zero)."""
    R = rows_RM.shape[0]
    e, L1 = runs_sL.shape
    L = L1 - 1
    ends = jnp.cumsum(runs_sL.reshape(-1))
    run_R = jnp.searchsorted(ends, jnp.arange(R), side="right")
    # Padding gets the id L, so the stable sort puts it after every group.
    local_R = jnp.where((run_R < e * L1) & (run_R % L1 < L), run_R % L1, L)
    order_R = jnp.argsort(local_R, stable=True)
    y_RM = compute(rows_RM[order_R], jnp.sum(runs_sL[:, :L], axis=0))
    return jnp.zeros_like(y_RM).at[order_R].set(y_RM)


def packet_rows(platform: str, row_bytes: int) -> int:
    """Rows the ragged exchange sends as one unit. TPU pads every row of a ragged all-to-all to
    a 512-byte tile (a bf16 row of 64 is sent as [2, 128]: 4x its bytes; seen in the compiled
    HLO), so narrow rows travel in groups filling one tile; elsewhere rows go one by one."""
    if platform != "tpu" and not _RAGGED.get("packet_rows"):
        return 1
    return _RAGGED.get("packet_rows") or max(1, -(-512 // row_bytes))


def ragged_exchange(x_XM, counts_E, compute, axis: str, packet: int = 1):
    """(y_XM, 0 dropped): every row sent once to its expert's shard and back (dropless).

    With `packet` g > 1, each destination's run is padded to a multiple of g rows and sent as
    rows of g x M (under g rows of padding per destination and device)."""
    e = jax.lax.axis_size(axis)
    me = jax.lax.axis_index(axis)
    X, M = x_XM.shape
    L = counts_E.shape[0] // e
    g = packet
    # Every device's per-expert counts (e x E int32s): each side derives all offsets from them.
    counts_sdL = jax.lax.all_gather(counts_E, axis).reshape(e, e, L)  # [source, dest, local]
    rows_sd = jnp.sum(counts_sdL, axis=2)  # rows source s sends to shard d
    packets_sd = -(-rows_sd // g)  # the same in packets of g rows
    # On shard d, the blocks from the sources lie in source order.
    at_dest_sd = _exclusive_cumsum(packets_sd, axis=0)
    # On source s, the blocks for the shards lie in shard order (sorted by expert id).
    at_source_sd = _exclusive_cumsum(packets_sd, axis=1)
    send_d, recv_s = packets_sd[me], packets_sd[:, me]

    # This device's rows laid out in padded blocks: slot p of block d holds sorted row
    # start_d + (p - g * at_source_d) when that is inside the block's rows.
    S = -(-(X + e * (g - 1)) // g)  # packets enough for any routing
    start_d = _exclusive_cumsum(rows_sd[me])
    slot = jnp.arange(S * g)
    block = jnp.clip(jnp.searchsorted(g * at_source_sd[me], slot, side="right") - 1, 0, e - 1)
    within = slot - g * at_source_sd[me][block]
    valid = within < rows_sd[me][block]
    row = jnp.where(valid, start_d[block] + within, 0)
    send_PgM = jnp.where(valid[:, None], x_XM[row], 0).reshape(S, g * M)

    received = _ragged_all_to_all(
        send_PgM,
        jnp.zeros((e * S, g * M), x_XM.dtype),
        at_source_sd[me],
        send_d,
        at_dest_sd[me],
        recv_s,
        axis_name=axis,
    )
    runs_sL = jnp.concatenate([counts_sdL[:, me], (g * recv_s - rows_sd[:, me])[:, None]], axis=1)
    y_RM = _group_and_compute(received.reshape(e * S * g, M), runs_sL, compute)
    back = _ragged_all_to_all(
        y_RM.reshape(e * S, g * M),
        jnp.zeros((S, g * M), y_RM.dtype),
        at_dest_sd[:, me],
        recv_s,
        at_source_sd[:, me],
        send_d,
        axis_name=axis,
    )
    # Sorted row x sits at slot g * at_source_d + (x - start_d) of its block d.
    dest_X = jnp.minimum(
        jnp.searchsorted(jnp.cumsum(rows_sd[me]), jnp.arange(X), side="right"), e - 1
    )
    slot_X = g * at_source_sd[me][dest_X] + jnp.arange(X) - start_d[dest_X]
    return back.reshape(S * g, M)[slot_X], jnp.zeros((), jnp.int32)


def capacity(rows: int, shards: int, capacity_factor: float) -> int:
    """Rows per destination shard of the padded exchange: all `rows` (dropless) when the
    factor is 0, else ceil(factor x rows / shards), at most `rows`."""
    if capacity_factor <= 0:
        return rows
    return max(1, min(rows, math.ceil(capacity_factor * rows / shards)))


def padded_exchange(x_XM, counts_E, compute, axis: str, capacity_factor: float):
    """(y_XM, dropped): [e, C, M] buffers all_to_all'd; rows past C per shard are dropped."""
    e = jax.lax.axis_size(axis)
    X, M = x_XM.shape
    L = counts_E.shape[0] // e
    C = capacity(X, e, capacity_factor)
    counts_dL = counts_E.reshape(e, L)
    rows_d = jnp.sum(counts_dL, axis=1)
    start_d = _exclusive_cumsum(rows_d)
    # The first C rows of each shard's run are kept; its per-expert counts are cut to match.
    kept_dL = jnp.diff(jnp.minimum(jnp.cumsum(counts_dL, axis=1), C), axis=1, prepend=0)
    kept_d = jnp.minimum(rows_d, C)
    row_dC = start_d[:, None] + jnp.arange(C)[None, :]
    valid_dC = jnp.arange(C)[None, :] < kept_d[:, None]
    send_dCM = jnp.where(valid_dC[..., None], x_XM[jnp.minimum(row_dC, X - 1)], 0)

    recv_sCM = jax.lax.all_to_all(send_dCM, axis, 0, 0, tiled=True)
    recv_counts_sL = jax.lax.all_to_all(kept_dL, axis, 0, 0, tiled=True)
    # Each source's block of C rows: its kept rows sorted by local expert, then padding.
    pad_s = C - jnp.sum(recv_counts_sL, axis=1)
    runs_sL = jnp.concatenate([recv_counts_sL, pad_s[:, None]], axis=1)
    y_sCM = _group_and_compute(recv_sCM.reshape(-1, M), runs_sL, compute).reshape(e, C, M)

    back_dCM = jax.lax.all_to_all(y_sCM, axis, 0, 0, tiled=True)
    # Row x of the sorted order went to shard dest_X at position x - start; past C: dropped.
    dest_X = jnp.minimum(jnp.searchsorted(jnp.cumsum(rows_d), jnp.arange(X), side="right"), e - 1)
    pos_X = jnp.arange(X) - start_d[dest_X]
    y_XM = jnp.where((pos_X < C)[:, None], back_dCM[dest_X, jnp.minimum(pos_X, C - 1)], 0).astype(
        y_sCM.dtype
    )
    dropped = jnp.sum(rows_d - kept_d).astype(jnp.int32)
    return y_XM, dropped
