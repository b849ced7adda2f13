"""Score many token sequences at once: pack them into rows, run the model, read log-probs back.

A request is a token sequence and how many of its last ids to score (each predicted by the id
before it). Requests are sorted longest first and packed first-fit into rows of one length R
(the longest request rounded up to a power of two, at least 64): each request is one segment
of its row (segment ids 1, 2, ... with positions from 0), so attention never crosses requests
and each is scored exactly as if it ran alone; the rest of a row is padding (segment 0). Rows
go to the model `rows` at a time (a multiple of the mesh's batch split; the last batch is
filled with empty rows), so one compiled function serves a whole request list.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_zoo.errors import UsageError
from zoo.loss import target_mask

MIN_ROW = 64


@dataclasses.dataclass(frozen=True)
class Scored:
    logprob: float  # sum of the scored ids' log-probabilities (nats)
    greedy: bool  # every scored id is the model's argmax at its position


def row_length(longest: int, limit: int | None = None) -> int:
    """Power of two >= `longest` (at least MIN_ROW), but `limit` when that is shorter."""
    r = max(MIN_ROW, 1 << max(longest - 1, 0).bit_length())
    return max(longest, min(r, limit)) if limit else r


def pack(lengths: Sequence[int], row_len: int) -> list[list[int]]:
    """Request indices per row: first-fit over the requests sorted longest first."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    rows: list[list[int]] = []
    free: list[int] = []
    for i in order:
        n = lengths[i]
        if n > row_len:
            raise UsageError(f"a request of {n} tokens does not fit rows of {row_len}")
        for r, room in enumerate(free):
            if n <= room:
                rows[r].append(i)
                free[r] -= n
                break
        else:
            rows.append([i])
            free.append(row_len - n)
    return rows


@functools.partial(jax.jit, static_argnames="graphdef")
def _score_rows(graphdef, state, tokens_BT, segment_ids_BT, positions_BT):
    """(log p(next id), next id is the argmax) at every position, float32 / bool [B, T],
    replicated so every process reads all rows."""
    model = nnx.merge(graphdef, state)
    logits_BTV = model(tokens_BT, segment_ids=segment_ids_BT, positions=positions_BT)
    logits_BTV = logits_BTV.astype(jnp.float32)
    targets_BT, _ = target_mask(tokens_BT, segment_ids_BT)
    # A one-hot laid out like the logits keeps the pick local to each vocab shard (see
    # zoo/loss.py); the max and logsumexp reduce over the shards.
    one_hot_BTV = jax.nn.one_hot(targets_BT, logits_BTV.shape[-1], dtype=jnp.float32)
    one_hot_BTV = jax.sharding.reshard(one_hot_BTV, jax.typeof(logits_BTV).sharding.spec)
    target_BT = jnp.sum(logits_BTV * one_hot_BTV, axis=-1)
    logprob_BT = target_BT - jax.nn.logsumexp(logits_BTV, axis=-1)
    greedy_BT = target_BT >= jnp.max(logits_BTV, axis=-1)
    return jax.sharding.reshard(logprob_BT, P()), jax.sharding.reshard(greedy_BT, P())


def batch_multiple(model, mesh) -> int:
    """Rows must divide by the mesh size of the tokens' batch dim."""
    axes = model.sharding.tokens[0]
    if axes is None:
        return 1
    axes = axes if isinstance(axes, tuple) else (axes,)
    return math.prod(mesh.shape[a] for a in axes)


def score(
    model,
    mesh,
    requests: Sequence[tuple[Sequence[int], int]],
    *,
    rows: int,
    max_row: int | None = None,
    pack_rows: bool = True,
) -> list[Scored]:
    """Scored sums for each (ids, n): the log-probability of the last `n` ids of `ids` given
    the ids before them. `rows` per call (rounded up to the mesh's batch split); with
    `pack_rows=False` each request gets a row of its own (padded rows)."""
    if not requests:
        return []
    lengths = [len(ids) for ids, _ in requests]
    for ids, n in requests:
        if not 1 <= n < len(ids):
            raise UsageError(f"cannot score {n} of {len(ids)} ids (one id at least conditions)")
    row_len = row_length(max(lengths), max_row)
    packed = pack(lengths, row_len) if pack_rows else [[i] for i in np.argsort(lengths)[::-1]]
    multiple = batch_multiple(model, mesh)
    rows = -(-max(rows, 1) // multiple) * multiple
    sharding = NamedSharding(mesh, model.sharding.tokens)
    graphdef, state = nnx.split(model)
    results: list[Scored | None] = [None] * len(requests)
    for start in range(0, len(packed), rows):
        batch = packed[start : start + rows]
        tokens, segment_ids, positions = (np.zeros((rows, row_len), np.int32) for _ in range(3))
        where = []  # (request, row, first column)
        for r, members in enumerate(batch):
            col = 0
            for seg, i in enumerate(members, start=1):
                ids = requests[i][0]
                tokens[r, col : col + len(ids)] = ids
                segment_ids[r, col : col + len(ids)] = seg
                positions[r, col : col + len(ids)] = np.arange(len(ids))
                where.append((i, r, col))
                col += len(ids)
        arrays = [
            jax.make_array_from_callback(a.shape, sharding, lambda idx, a=a: a[idx])
            for a in (tokens, segment_ids, positions)
        ]
        with jax.set_mesh(mesh):
            logprob_BT, greedy_BT = _score_rows(graphdef, state, *arrays)
        logprob_BT, greedy_BT = np.asarray(logprob_BT), np.asarray(greedy_BT)
        for i, r, col in where:
            ids, n = requests[i]
            # Position t predicts id t + 1: the last n ids are predicted at [end-n-1, end-1).
            end = col + len(ids)
            span = slice(end - n - 1, end - 1)
            results[i] = Scored(
                float(logprob_BT[r, span].astype(np.float64).sum()), bool(greedy_BT[r, span].all())
            )
    return results
