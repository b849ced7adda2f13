"""The xla backend: einsums with every layout declared, on every platform.

Dims as in the package: B batch, T queries, S keys, N / K query / kv heads, G = N // K, D.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from zoo.layers.attention.layout import plan_layout, reshard_segments, reshard_to
from zoo.layers.attention.mask import Segments, attention_mask, is_static
from zoo.layers.attention.registry import register_backend

# Where a mask excludes a logit. Finite, not -inf: a row with nothing visible then softmaxes
# to a uniform average instead of NaN, and its gradient stays finite.
_MASKED_LOGIT = float(np.finfo(np.float32).min)


# Causal self-attention on the XLA path runs in query blocks, each against the keys up to its
# end (and from its window's start): the blocks above the diagonal, all masked, are never
# computed. With n blocks that is (n + 1) / 2n of the logits (62% at n = 4, 56% at n = 8),
# and of the memory traffic of the mask, softmax and transposes around them, which on CPU
# cost about as much as the two matmuls (bench/vs_transformers.py: +16% train, +25% forward
# tokens/s on the `small` model at T = 512). Blocks of at least this many queries, at most
# this many blocks (each block is its own matmuls in the compiled program):
_MIN_QUERY_BLOCK = 128
_MAX_QUERY_BLOCKS = 8


def causal_blocks(T: int, S: int, causal: bool, sliding_window, self_attention: bool, lay):
    """[(t0, t1, s0, s1)]: query rows t0:t1 attend key rows s0:s1; None for one block.

    Exact where key index order is position order within a document (the Segments
    convention): a key after the query's index is then later in its document or in another
    one, masked either way; so is a key more than the window before the block. Only a
    padding query (segment 0, which the loss ignores) may see fewer padding keys.
    """
    if not causal or not self_attention or T != S or T % _MIN_QUERY_BLOCK:
        return None
    if lay is not None and tuple(lay.q)[1] is not None:  # T split (context parallelism)
        return None
    n = min(_MAX_QUERY_BLOCKS, T // _MIN_QUERY_BLOCK)
    while T % n:
        n -= 1
    if n < 2:
        return None
    size = T // n
    window = sliding_window if is_static(sliding_window) and sliding_window else None
    blocks = []
    for t0 in range(0, T, size):
        s0 = 0 if window is None else max(0, (t0 - window + 1) // size * size)
        blocks.append((t0, t0 + size, s0, t0 + size))
    return blocks


def xla_attention(
    q_BTND,
    k_BSKD,
    v_BSKD,
    segments: Segments,
    *,
    scale,
    causal,
    sliding_window,
    out_sharding,
    interpret: bool = False,
    sinks=None,
):
    """`sinks`: None or [N] attention-sink logits, each joining its head's softmax denominator."""
    del interpret
    # Before any reshard: the same ids array for queries and keys is self-attention.
    self_attention = segments.q_ids_BT is segments.kv_ids_BS
    B, T, N, D = q_BTND.shape
    K = k_BSKD.shape[2]
    G = N // K
    lay = plan_layout(q_BTND, k_BSKD)
    if lay is not None:
        q_BTND = reshard_to(q_BTND, lay.q)
        k_BSKD = reshard_to(k_BSKD, lay.kv)
        v_BSKD = reshard_to(v_BSKD, lay.kv)
        segments = reshard_segments(segments, lay)

    def spec(name):
        return None if lay is None else getattr(lay, name)

    mask_BTS = attention_mask(segments, causal=causal, sliding_window=sliding_window)
    q_BTKGD = jnp.reshape(q_BTND, (B, T, K, G, D), out_sharding=spec("grouped"))

    blocks = causal_blocks(T, k_BSKD.shape[1], causal, sliding_window, self_attention, lay)
    sinks_KG = None if sinks is None else sinks.astype(jnp.float32).reshape(K, G)
    if self_attention:
        # Shaped as the heads-major logits [B, K, T, G, S] without S.
        sinks_BKTG = None if sinks_KG is None else sinks_KG[None, :, None, :]
        out_BTKGD = _heads_major(q_BTKGD, k_BSKD, v_BSKD, mask_BTS, blocks, scale, lay, sinks_BKTG)
    else:
        out_BTKGD = _attend(
            "BTKGD,BSKD->BKGTS",
            "BKGTS,BSKD->BTKGD",
            q_BTKGD,
            k_BSKD,
            v_BSKD,
            mask_BTS[:, None, None],
            scale,
            spec("logits"),
            spec("grouped"),
            None if sinks_KG is None else sinks_KG[None, :, :, None],  # [B, K, G, T]
        )
    out_BTND = jnp.reshape(out_BTKGD, (B, T, N, D), out_sharding=spec("out"))
    out_BTND = out_BTND.astype(q_BTND.dtype)
    if lay is not None and out_sharding is not None:
        # The output comes out in q's (possibly head-gathered) layout; reshard only when the
        # declared one differs, so the usual case (declared == q's) adds nothing.
        out_BTND = reshard_to(out_BTND, out_sharding)
    return out_BTND


def _attend(logits_eq, out_eq, q, k, v, mask, scale, logits_spec, out_spec, sinks=None):
    """softmax(mask(q.k * scale)).v with the two einsums given; `mask` broadcasts to the logits.

    `sinks` (broadcasting to the logits without their key dim): one more logit per row in the
    denominator, with no value -- transformers' GPT-OSS concatenates it to the logits,
    softmaxes and drops its column, which is this.

    Logits, softmax and the weighted sum accumulate in float32 whatever the input dtype (as
    jax.nn.dot_product_attention and the cuDNN kernel do); probabilities are cast back to
    v's dtype for the second matmul.
    """
    logits = jnp.einsum(
        logits_eq, q, k, preferred_element_type=jnp.float32, out_sharding=logits_spec
    )
    logits = jnp.where(mask, logits * scale, _MASKED_LOGIT)
    if sinks is None:
        probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    else:
        top = jnp.maximum(jnp.max(logits, axis=-1, keepdims=True), sinks[..., None])
        top = jax.lax.stop_gradient(top)
        e = jnp.exp(logits - top)
        denominator = jnp.sum(e, axis=-1, keepdims=True) + jnp.exp(sinks[..., None] - top)
        probs = (e / denominator).astype(v.dtype)
    return jnp.einsum(out_eq, probs, v, preferred_element_type=jnp.float32, out_sharding=out_spec)


def _heads_major(q_BTKGD, k_BSKD, v_BSKD, mask_BTS, blocks, scale, lay, sinks=None):
    """Self-attention with heads ahead of positions: logits [B, K, T, G, S], S minor.

    The [T, D]-sized q, k and v are transposed once so each (b, k) pair is a plain
    row-major [T*G, D] x [D, S] and [T*G, S] x [S, D] matmul: the [T, S]-sized logits and
    probabilities, which the token-major einsums made XLA CPU transpose before and after
    each matmul, are then written and read once each in the order they are stored. At the
    `small` model's shape (4x512, CPU) this halves the attention forward and cuts forward +
    backward by about a fifth; the 3.4M model of bench/vs_transformers.py trains ~20% faster.
    KV-cache calls (T != S) keep the token-major path: there it would transpose the cache.
    """
    qb, qt, kv_heads, group = (None,) * 4 if lay is None else tuple(lay.grouped)[:4]
    grouped = None if lay is None else P(qb, kv_heads, qt, group, None)
    q_BKTGD = jnp.transpose(q_BTKGD, (0, 2, 1, 3, 4))
    k_BKSD = jnp.transpose(k_BSKD, (0, 2, 1, 3))
    v_BKSD = jnp.transpose(v_BSKD, (0, 2, 1, 3))

    def one(q_BKTGD, k_BKSD, v_BKSD, mask_BTS):
        return _attend(
            "BKTGD,BKSD->BKTGS",
            "BKTGS,BKSD->BKTGD",
            q_BKTGD,
            k_BKSD,
            v_BKSD,
            mask_BTS[:, None, :, None],
            scale,
            grouped,
            grouped,
            sinks,
        )

    if blocks is None:
        out_BKTGD = one(q_BKTGD, k_BKSD, v_BKSD, mask_BTS)
    else:
        outs = [
            one(
                q_BKTGD[:, :, t0:t1],
                k_BKSD[:, :, s0:s1],
                v_BKSD[:, :, s0:s1],
                mask_BTS[:, t0:t1, s0:s1],
            )
            for t0, t1, s0, s1 in blocks
        ]
        out_BKTGD = jnp.concatenate(outs, axis=2)
    return jnp.transpose(out_BKTGD, (0, 2, 1, 3, 4))


register_backend("xla", xla_attention, keeps_layout=True, sinks=True)
