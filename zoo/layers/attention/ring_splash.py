"""Ring attention's blocks on TPU: the Pallas splash kernel per K/V block (ring.py calls it).

Dims as in ring.py. The ring runs in context_parallel's load-balanced order: of the 2c chunks
of a row, device i holds chunks i and 2c-1-i, so its local index order is global index order.
Under the Segments convention (within a document, positions advance with the index; a key at
a later index is later in its document or in another one), which keys a query may see follows
from the indices, and each ring step is one of three static masks:

- step 0, its own block: causal over the local indices;
- from a device src < i: every local query sees the block's front chunk (earlier) and none of
  its back chunk (later): [T, S/2], full;
- from src > i: only the back chunk's queries see anything, all of the block: [T/2, S], full.

So every step after the first computes half the block, and splash skips the masked tiles of
the first: a causal row's pairs once, as on one device. Documents are kept apart by segment
ids. As the splash backend itself, a padding query (segment 0, which the loss ignores) sees
only the padding keys before it.

The ring's backward needs each block's dq, dk, dv under the final log-sum-exp and output of
all blocks (ring.py), which splash's public call does not take: its own backward kernels are
called with those as their residuals (`_splash_attention_bwd`, private to jax's splash
module; `available()` says whether this jax has it, else the ring runs xla blocks).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

from zoo.layers.attention.splash import mha_kernel, on_fresh_thread

# A block where no query sees anything: the log-sum-exp it contributes (weight exp(-huge) = 0).
_EMPTY_LSE = splash.DEFAULT_MASK_VALUE


def available() -> bool:
    return hasattr(splash, "_splash_attention_bwd") and hasattr(splash, "SplashAttentionKernel")


@functools.lru_cache(maxsize=64)
def _kernel(heads: int, T: int, S: int, causal: bool, interpret: bool):
    return on_fresh_thread(_build, heads, T, S, causal, interpret)


def _build(heads, T, S, causal, interpret):
    mask = masks.CausalMask((T, S)) if causal else masks.FullMask((T, S))
    return mha_kernel(mask, heads, T, S, interpret=interpret, save_residuals=True)


def _to_heads_major(q_BTKGD, k_BSKD, v_BSKD, scale):
    B, T, K, G, D = q_BTKGD.shape
    # The kernel has no scale argument: q is scaled, so its lse is the scaled logits'.
    q_BTND = (q_BTKGD * jnp.asarray(scale, q_BTKGD.dtype)).reshape(B, T, K * G, D)
    q_BNTD = jnp.swapaxes(q_BTND, 1, 2)
    return q_BNTD, jnp.swapaxes(k_BSKD, 1, 2), jnp.swapaxes(v_BSKD, 1, 2)


def _forward(kernel, q_BTKGD, k_BSKD, v_BSKD, q_ids, kv_ids, scale):
    """(out_BTKGD float32, lse_BTKG) of one splash call over these queries and keys."""
    B, T, K, G, D = q_BTKGD.shape
    q, k, v = _to_heads_major(q_BTKGD, k_BSKD, v_BSKD, scale)

    def one_row(q, k, v, q_ids, kv_ids):
        return kernel(q, k, v, segment_ids=splash.SegmentIds(q=q_ids, kv=kv_ids))

    out_BNTD, (lse_BNT,) = jax.vmap(one_row)(q, k, v, q_ids, kv_ids)
    out = jnp.swapaxes(out_BNTD, 1, 2).reshape(B, T, K, G, D).astype(jnp.float32)
    return out, jnp.swapaxes(lse_BNT, 1, 2).reshape(B, T, K, G)


def _backward(kernel, q_BTKGD, k_BSKD, v_BSKD, q_ids, kv_ids, scale, out, lse, dout):
    """(dq_BTKGD, dk_BSKD, dv_BSKD) float32 of one splash call, given the final output and
    log-sum-exp of all blocks (so the kernel's probabilities are the true ones)."""
    B, T, K, G, D = q_BTKGD.shape
    q, k, v = _to_heads_major(q_BTKGD, k_BSKD, v_BSKD, scale)
    heads_major = lambda x: jnp.swapaxes(x.reshape(B, T, K * G, D), 1, 2)  # noqa: E731
    out_BNTD, dout_BNTD = heads_major(out.astype(q.dtype)), heads_major(dout.astype(q.dtype))
    lse_BNT = jnp.swapaxes(lse.reshape(B, T, K * G), 1, 2)
    options = dict(kernel.kwargs)
    mask_infos = [_collapsed(kernel.dq_mask_info), _collapsed(kernel.dkv_mask_info)]

    def one_row(q, k, v, q_ids, kv_ids, o, lse, do):
        res = (q, k, v, splash.SegmentIds(q=q_ids, kv=kv_ids), None, o, lse, *mask_infos)
        grads = splash._splash_attention_bwd(
            False,  # save_residuals
            options["mask_value"],
            options["is_mqa"],
            options["block_sizes"],
            options["residual_checkpoint_name"],
            options["mask_function"],
            options["attn_logits_soft_cap"],
            options["interpret"],
            res,
            do,
        )
        return grads[3:6]

    dq, dk, dv = jax.vmap(one_row)(q, k, v, q_ids, kv_ids, out_BNTD, lse_BNT, dout_BNTD)
    dq_BTKGD = jnp.swapaxes(dq, 1, 2).reshape(B, T, K, G, D).astype(jnp.float32) * scale
    dk_BSKD = jnp.swapaxes(dk, 1, 2).astype(jnp.float32)
    dv_BSKD = jnp.swapaxes(dv, 1, 2).astype(jnp.float32)
    return dq_BTKGD, dk_BSKD, dv_BSKD


def _collapsed(mask_info):
    # As splash's own entry point does before its custom VJP: [heads, q blocks, kv blocks, bq,
    # bkv] partial mask blocks flattened to [-1, bq, bkv].
    if mask_info is None or mask_info.partial_mask_blocks is None:
        return mask_info
    blocks = mask_info.partial_mask_blocks
    return mask_info._replace(partial_mask_blocks=blocks.reshape(-1, *blocks.shape[-2:]))


class SplashBlocks:
    """The ring's per-step block attention with splash (see the module docstring)."""

    def __init__(self, *, scale: float, context: int, axis: str, interpret: bool):
        self.scale, self.c, self.axis, self.interpret = scale, context, axis, interpret

    def _kernels(self, N, T, S):
        own = _kernel(N, T, S, True, self.interpret)
        front = _kernel(N, T, S // 2, False, self.interpret)  # src < i: the block's front
        back = _kernel(N, T // 2, S, False, self.interpret)  # src > i: our back chunk's queries
        return own, front, back

    def _earlier(self, step):
        # src = (i - step) mod c is an earlier device exactly when step <= i.
        return step <= jax.lax.axis_index(self.axis)

    def forward(self, step, q, k, v, segments, window):
        del window  # none (ring.block_kernel)
        q_ids, kv_ids = segments.q_ids_BT, segments.kv_ids_BS
        B, T, K, G, D = q.shape
        S = k.shape[1]
        own, front, back = self._kernels(K * G, T, S)
        if isinstance(step, int) and step == 0:  # else a later step (traced in a loop)
            return _forward(own, q, k, v, q_ids, kv_ids, self.scale)

        def from_earlier(q, k, v, q_ids, kv_ids):
            half = S // 2
            return _forward(front, q, k[:, :half], v[:, :half], q_ids, kv_ids[:, :half], self.scale)

        def from_later(q, k, v, q_ids, kv_ids):
            half = T // 2
            out, lse = _forward(back, q[:, half:], k, v, q_ids[:, half:], kv_ids, self.scale)
            out = jnp.concatenate([jnp.zeros_like(out), out], axis=1)
            lse = jnp.concatenate([jnp.full_like(lse, _EMPTY_LSE), lse], axis=1)
            return out, lse

        return jax.lax.cond(self._earlier(step), from_earlier, from_later, q, k, v, q_ids, kv_ids)

    def backward(self, step, q, k, v, segments, window, out, lse, dout, delta):
        del window, delta  # the kernel takes its delta from `out`
        q_ids, kv_ids = segments.q_ids_BT, segments.kv_ids_BS
        B, T, K, G, D = q.shape
        S = k.shape[1]
        own, front, back = self._kernels(K * G, T, S)
        if isinstance(step, int) and step == 0:  # else a later step (traced in a loop)
            return _backward(own, q, k, v, q_ids, kv_ids, self.scale, out, lse, dout)

        def from_earlier(q, k, v, q_ids, kv_ids, out, lse, dout):
            front_half = lambda x: x[:, : S // 2]  # noqa: E731
            k, v, kv_ids = front_half(k), front_half(v), front_half(kv_ids)
            dq, dk, dv = _backward(front, q, k, v, q_ids, kv_ids, self.scale, out, lse, dout)
            pad = lambda x: jnp.concatenate([x, jnp.zeros_like(x)], axis=1)  # noqa: E731
            return dq, pad(dk), pad(dv)

        def from_later(q, k, v, q_ids, kv_ids, out, lse, dout):
            half = T // 2
            back_only = lambda x: x[:, half:]  # noqa: E731
            dq, dk, dv = _backward(
                back,
                back_only(q),
                k,
                v,
                back_only(q_ids),
                kv_ids,
                self.scale,
                back_only(out),
                back_only(lse),
                back_only(dout),
            )
            return jnp.concatenate([jnp.zeros_like(dq), dq], axis=1), dk, dv

        return jax.lax.cond(
            self._earlier(step),
            from_earlier,
            from_later,
            q,
            k,
            v,
            q_ids,
            kv_ids,
            out,
            lse,
            dout,
        )
