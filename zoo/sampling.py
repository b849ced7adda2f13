"""The one sampler: one token per row of a batch whose rows carry their own settings.

`zoo.generate` (and so `eval_main --prompt` and lm-eval's generation) and the server's decode
slots (`nnx_zoo/serving/slots.py`) all draw here, so a seeded request gives the same text from
either. The server's slots hold unrelated requests: one greedy, one at temperature 0.7 with
top_p 0.9, one with top_k 40. Each row's settings are arrays here ([B] each), so one compiled
step serves every mix. The order of the filters is transformers': temperature, then top-k,
then the nucleus. Values are picked out of the batch-split rows with masked sums, not gathers
(a gather from a `B/data` array needs an output layout under explicit sharding).

Randomness is keyed by the request, never by the batch: row b draws with
`fold_in(key(seed_b), position_b)`, the position the drawn token will take in its sequence.
So a seeded request draws the same tokens alone, batched with others, or in another slot,
and a request needs no key state carried between steps.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P


class SamplingRows(NamedTuple):
    """Per-row settings, [B] each. `temperature` 0: greedy (argmax; the rest is ignored)."""

    temperature: jax.Array  # float32
    top_k: jax.Array  # int32; >= V (or <= 0) keeps every token
    top_p: jax.Array  # float32 in (0, 1]; 1 keeps every token
    seed: jax.Array  # uint32


def pick(x_BV, i_B):
    """x_BV[b, i_B[b]] for every b, as a masked sum (exact: the other terms are zeros)."""
    columns_BV = jax.lax.broadcasted_iota(jnp.int32, x_BV.shape, 1)
    return jnp.sum(jnp.where(columns_BV == i_B[:, None], x_BV, 0), axis=-1)


def nucleus(logits_BV, top_p_B):
    """-inf outside each row's nucleus: the most likely tokens whose probabilities first
    reach that row's top_p in total (at least one). As transformers' TopPLogitsWarper,
    applied after temperature and top-k: a token stays when the mass of the tokens more likely
    than it is below top_p (a tie at the edge keeps every tied token)."""
    sorted_BV = jnp.sort(logits_BV, axis=-1, descending=True)
    probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
    above_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV  # the mass ranked above each token
    kept_B = jnp.maximum(jnp.sum(above_BV < top_p_B[:, None], axis=-1), 1)
    edge_B1 = pick(sorted_BV, kept_B - 1)[:, None]
    return jnp.where(logits_BV < edge_B1, -jnp.inf, logits_BV)


def _rows_like(x_B, like_BV):
    """`x_B` with its rows split as `like_BV`'s (a reshard only when they differ)."""
    want = jax.typeof(like_BV).sharding.spec
    rows_axis = want[0] if len(want) else None
    now = jax.typeof(x_B).sharding.spec
    if (now[0] if len(now) else None) == rows_axis or jax.typeof(x_B).sharding.mesh.empty:
        return x_B
    return jax.sharding.reshard(x_B, P(rows_axis))


def sample(logits_BV, rows: SamplingRows, position_B):
    """int32 [B]: each row's next token. `logits_BV` float32 with whole rows (V unsplit)."""
    greedy_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    sampled_B = rows.temperature > 0

    def draw():
        V = logits_BV.shape[-1]
        # A greedy row divides by 1: its draw is discarded, but must not be inf/nan work.
        temperature_B1 = jnp.where(sampled_B, rows.temperature, 1.0)[:, None]
        logits = logits_BV / temperature_B1
        top_k_B = jnp.where((rows.top_k <= 0) | (rows.top_k > V), V, rows.top_k)
        sorted_BV = jnp.sort(logits, axis=-1, descending=True)
        kth_B1 = pick(sorted_BV, top_k_B - 1)[:, None]
        logits = jnp.where(logits < kth_B1, -jnp.inf, logits)
        # top_p = 1 keeps every token exactly (a cumulative sum can reach 1.0 early in float32).
        top_p_B1 = rows.top_p[:, None]
        logits = jnp.where(top_p_B1 < 1.0, nucleus(logits, rows.top_p), logits)
        # vmap needs its inputs' mapped dims split alike (jax 0.12 refuses a `data` seed
        # beside a replicated position), so both follow the logits' rows.
        seed_B = _rows_like(rows.seed, logits)
        keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(
            seed_B, _rows_like(position_B, logits)
        )
        drawn_B = jax.vmap(jax.random.categorical)(keys, logits).astype(jnp.int32)
        return jnp.where(sampled_B, drawn_B, greedy_B)

    # An all-greedy batch (the common case of tools and evals) skips the sort over V.
    return jax.lax.cond(jnp.any(sampled_B), draw, lambda: greedy_B)


def rows(
    batch: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
) -> SamplingRows:
    """The same settings for `batch` rows (numpy; lay them out as the batch is); row r draws
    with seed + r, as choice r of a seeded server request does."""
    return SamplingRows(
        np.full((batch,), temperature, np.float32),
        np.full((batch,), 0 if top_k is None else top_k, np.int32),
        np.full((batch,), 1.0 if top_p is None else top_p, np.float32),
        ((seed + np.arange(batch)) % 2**32).astype(np.uint32),
    )
