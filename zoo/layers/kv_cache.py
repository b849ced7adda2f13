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
    index: jax.Array  # [] int32: the slot the next step's first token goes to


class LayerCache(NamedTuple):
    """One layer's keys and values, with the cache's segment ids and positions already
    holding this step's tokens, whose keys and values attention writes at `index`."""

    k: jax.Array  # [B, S, K, D]
    v: jax.Array  # [B, S, K, D]
    segment_ids: jax.Array  # [B, S]
    positions: jax.Array  # [B, S]
    index: jax.Array  # []
