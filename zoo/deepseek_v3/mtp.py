"""DeepSeek-V3's multi-token prediction (arXiv 2412.19437, section 2.2): D sequential
modules beside the model, depth k predicting token i + k + 1 from position i.

Depth k takes the previous depth's hidden state h_i (depth 1: the model's final-normed one,
what its LM head reads, as vLLM, SGLang and Megatron feed it) and the embedding of token
i + k, and computes

    h'_i = eh_proj([enorm(Emb(t_{i+k})), hnorm(h_i)])      (embedding first)
    h_i  = Block(h'_i)                                       (MLA + MoE, as the MoE layers)
    P    = LMHead(head_norm(h_i))                           (predicts t_{i+k+1})

The embedding and the LM head are the model's own (shared, as in the report). The report's
formula writes the concatenation [hnorm(h); enorm(emb)]; the published checkpoint's eh_proj
expects the embedding's half first (vLLM's and SGLang's deepseek_mtp, Megatron's MTP layer),
which is the order here. Depth k + 1 takes depth k's block output (before head_norm).

A position counts at depth k when its target t_{i+k+1} is in the same document (packed rows:
the segment ids agree), inside the row, and (chat data) marked trained; its attention stays
inside its document, so no prediction reads across a document boundary.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from shardings.specs import LmSharding
from zoo import loss
from zoo.layers.attention import Segments
from zoo.layers.basic import Einsum, Norm
from zoo.lm_head_loss import chunk_nll, chunked_token_nll


class MtpLoss(NamedTuple):
    """Each depth's next-next-token NLL summed over its counted positions, and their count."""

    total_D: jax.Array  # [D] float32
    count_D: jax.Array  # [D] int32

    def mean(self) -> jax.Array:
        """The mean over depths of each depth's mean NLL: the loss `mtp_loss_weight` weights."""
        per_depth = self.total_D / jnp.maximum(self.count_D, 1).astype(jnp.float32)
        return jnp.mean(per_depth)


class MtpModule(nnx.Module):
    """One depth: the two norms, the projection of their concatenation, `block` (a MoE
    layer of the model's kind) and the norm before the shared head."""

    def __init__(self, cfg, sharding: LmSharding, block: nnx.Module, *, rngs: nnx.Rngs):
        M, s = cfg.hidden_dim, sharding.mtp
        norm = dict(eps=cfg.norm_eps, dtype=cfg.compute_dtype)
        self.enorm = Norm(M, s.enorm, **norm)
        self.hnorm = Norm(M, s.hnorm, **norm)
        self.eh_proj = Einsum(
            "BTK,KM->BTM", (2 * M, M), s.eh_proj, rngs=rngs, dtype=cfg.compute_dtype
        )
        self.block = block
        self.head_norm = Norm(M, s.head_norm, **norm)


def target_mask(segment_ids_BT, k: int, loss_mask_BT=None):
    """(which positions count at depth k, `[B, T]` bool): position i's target t_{i+k+1} is
    in i's document and inside the row, and marked trained when `loss_mask_BT` is given.
    Packed documents are contiguous, so an equal segment id k + 1 ahead means every token
    between is of the same document."""
    T = segment_ids_BT.shape[1]
    ahead_BT = loss.shift_left(segment_ids_BT, k + 1)
    inside_T = jnp.arange(T) < T - (k + 1)
    mask_BT = (segment_ids_BT != 0) & (ahead_BT == segment_ids_BT) & inside_T
    if loss_mask_BT is not None:
        mask_BT = mask_BT & (loss.shift_left(loss_mask_BT, k + 1) != 0)
    return mask_BT


def head_nll(model, h_BTM, targets_BT, mask_BT, chunk_size: int):
    """The NLL `[B, T]` (0 where not counted) of the model's LM head on normed hidden states,
    fused with the loss over chunks when `chunk_size` > 0 (zoo/lm_head_loss.py)."""
    with jax.named_scope("lm_head_loss"):
        weight, head = model._head()
        if chunk_size:
            return chunked_token_nll(h_BTM, weight, targets_BT, mask_BT, head, chunk_size)
        return jnp.where(mask_BT, chunk_nll(head.logits(h_BTM, weight), targets_BT), 0.0)


def mtp_loss(
    model, h_BTM, tokens_BT, segment_ids_BT, positions_BT, *, loss_mask_BT, chunk_size, packed
) -> MtpLoss:
    """Every depth's summed NLL and count, from the model's final-normed hidden states."""
    segments = Segments.self_attention(segment_ids_BT, positions_BT, packed=packed)
    inv_freq_R = model.mtp_inv_freq()
    totals, counts = [], []
    for k, module in enumerate(model.mtp_blocks, start=1):
        with jax.named_scope(f"mtp_{k}"):
            e_BTM = model.embed(loss.shift_left(tokens_BT, k))
            both_BTK = jnp.concatenate([module.enorm(e_BTM), module.hnorm(h_BTM)], axis=-1)
            x_BTM = module.eh_proj(both_BTK)
            h_BTM, _ = model._call_block(module.block, x_BTM, segments, None, inv_freq_R, None)
            mask_BT = target_mask(segment_ids_BT, k, loss_mask_BT)
            targets_BT = loss.shift_left(tokens_BT, k + 1)
            nll_BT = head_nll(model, module.head_norm(h_BTM), targets_BT, mask_BT, chunk_size)
        totals.append(jnp.sum(nll_BT))
        counts.append(jnp.sum(mask_BT, dtype=jnp.int32))
    return MtpLoss(jnp.stack(totals), jnp.stack(counts))
