"""Next-token cross-entropy on (possibly vocab-split) logits, masked by segment ids."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


def target_mask(tokens_BT, segment_ids_BT):
    """(targets_BT, mask_BT): the target of position t is token t+1 of the same document.

    Padding (segment 0) and each document's last token (whose successor belongs to the next
    document, or is padding, or is past the row's end) carry no loss.
    """
    targets_BT = _next_along_t(tokens_BT)
    next_segment_BT = _next_along_t(segment_ids_BT)
    last_column = jnp.arange(tokens_BT.shape[1]) == tokens_BT.shape[1] - 1
    mask_BT = (segment_ids_BT != 0) & (next_segment_BT == segment_ids_BT) & ~last_column
    return targets_BT, mask_BT


def answer_mask(mask_BT, loss_mask_BT):
    """`mask_BT` (from `target_mask`) narrowed to the positions whose target token (t+1)
    is marked trained in `loss_mask_BT` (assistant turns, completions): the per-token loss
    mask of chat / instruction data."""
    return mask_BT & (_next_along_t(loss_mask_BT) != 0)


def shift_left(x_BT, k: int):
    """x[:, t + k] at t (wrapping round; the caller masks the last k columns), laid out as
    `x_BT`: multi-token prediction's inputs and targets k tokens ahead."""
    for _ in range(k):
        x_BT = _next_along_t(x_BT)
    return x_BT


def _next_along_t(x_BT):
    """x[:, t + 1] at t (wrapping round), also when T is split over a mesh axis (context
    parallelism): then a device's last position needs the next device's first token, which
    a sliced roll cannot express under sharding types; the [B, T] ids are gathered on T
    (a few bytes per token), rolled, and split again."""
    spec = tuple(jax.typeof(x_BT).sharding.spec) + (None, None)
    if spec[1] is None:
        return jnp.roll(x_BT, -1, axis=1)
    whole_BT = jax.sharding.reshard(x_BT, P(spec[0], None))
    return jax.sharding.reshard(jnp.roll(whole_BT, -1, axis=1), P(*spec[:2]))


def token_nll(logits_BTV, tokens_BT, segment_ids_BT):
    """(nll_BT, mask_BT) in float32.

    optax's integer-label cross-entropy gathers along V, which fails when V is split over
    `model` (the gather needs an output layout); a one-hot laid out like the logits keeps
    the sum local to each shard, and XLA reduces the partial sums over `model`.
    """
    targets_BT, mask_BT = target_mask(tokens_BT, segment_ids_BT)
    logits_BTV = logits_BTV.astype(jnp.float32)
    one_hot_BTV = jax.nn.one_hot(targets_BT, logits_BTV.shape[-1], dtype=jnp.float32)
    logits_sharding = jax.typeof(logits_BTV).sharding
    if not logits_sharding.mesh.empty:  # outside any mesh there is no layout to match
        one_hot_BTV = jax.sharding.reshard(one_hot_BTV, logits_sharding.spec)
    target_logit_BT = jnp.sum(logits_BTV * one_hot_BTV, axis=-1)
    nll_BT = jax.nn.logsumexp(logits_BTV, axis=-1) - target_logit_BT
    return jnp.where(mask_BT, nll_BT, 0.0), mask_BT


def lm_loss(logits_BTV, tokens_BT, segment_ids_BT):
    """(mean loss over counted tokens, number of counted tokens)."""
    nll_BT, mask_BT = token_nll(logits_BTV, tokens_BT, segment_ids_BT)
    count = jnp.sum(mask_BT)
    return jnp.sum(nll_BT) / jnp.maximum(count, 1), count
