"""The KV cache of generation as named structures: the model's (`KVCache`, every layer) and
the one a layer's attention reads and writes (`LayerCache`). Both are pytrees (NamedTuples),
so they pass through jit, scan and while loops as they are."""

from __future__ import annotations

from typing import NamedTuple

import jax


class KVCache(NamedTuple):
    k: jax.Array  # [L, B, S, K, D]
    v: jax.Array  # [L, B, S, K, D]
    segment_ids: jax.Array  # [B, S]; 0 = an empty slot, which no real query attends
    positions: jax.Array  # [B, S]
    # int32, the column the next step's first token goes to: [] (one for every row) or [B]
    # (each row its own; see `write`).
    index: jax.Array


class LayerCache(NamedTuple):
    """One layer's keys and values, with the cache's segment ids and positions already
    holding this step's tokens, whose keys and values attention writes at `index`."""

    k: jax.Array  # [B, S, K, D]
    v: jax.Array  # [B, S, K, D]
    segment_ids: jax.Array  # [B, S]
    positions: jax.Array  # [B, S]
    index: jax.Array  # [] or [B]


def write(cache_BS, new_BT, index):
    """`cache_BS` with `new_BT` written along axis 1 from column `index`: a scalar (every row
    at the same column, as `zoo.generate`'s left-padded batches write) or `[B]` int32 (each
    row at its own column: the decode slots of a serving engine, whose requests started at
    different times). Trailing dims ride along."""
    if index.ndim == 0:
        return jax.lax.dynamic_update_slice_in_dim(cache_BS, new_BT, index, axis=1)

    def row(cache_S, new_T, i):
        return jax.lax.dynamic_update_slice_in_dim(cache_S, new_T, i, axis=0)

    return jax.vmap(row)(cache_BS, new_BT, index)
