"""The `splash` backend: the Pallas TPU splash-attention kernel (block-sparse flash attention).

It never materializes the [B, N, T, S] scores: masks are index rules evaluated per block
(causal, local window), documents are kept apart by segment ids, and fully masked blocks are
skipped. The dispatcher runs it per device inside jax.shard_map over batch and heads (see
layout.per_shard), so each device calls the kernel on its own [B/data, T, N/model, D]
block with the whole sequence; it is vmapped over that local batch.

What index masks cannot say is the dispatcher's to route elsewhere (registry flags): T != S
(a KV-cache decode step, where query index t is not key index t) and a traced per-layer
window (the mask is built at trace time from Python ints).
"""

from __future__ import annotations

import concurrent.futures
import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

from zoo.layers.attention.mask import Segments, static_window
from zoo.layers.attention.registry import register_backend

_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
# Tile sizes tried in order: the largest that divides the sequence. 512 is what MaxText's
# splash wrapper defaults to; the kernel wants key tiles in multiples of 128 (TPU lanes), in
# interpret mode too.
_BLOCKS = (512, 256, 128)
_LANES = 128


def unavailable(call) -> str | None:
    """Why splash cannot run this call here (see registry.CallInfo), or None."""
    if call.platform != "tpu" and not call.interpret:
        return (
            f"needs a TPU (this process compiles for {call.platform}); on CPU only with "
            f"model.attention_interpret=True (Pallas interpret mode, slow, for tests)"
        )
    if jnp.dtype(call.dtype) not in _DTYPES:
        return f"needs float32 or bfloat16 inputs, got {jnp.dtype(call.dtype).name}"
    if call.q_len % _LANES or call.kv_len % _LANES:
        return f"needs sequence lengths that are multiples of {_LANES}, got {call.q_len}"
    return None


def block_size(length: int) -> int:
    """The tile size for a sequence of `length` (a multiple of 128): the largest that divides."""
    return next(b for b in _BLOCKS if length % b == 0)


@functools.lru_cache(maxsize=64)
def _kernel(heads: int, T: int, S: int, causal: bool, window: int | None, interpret: bool):
    """One kernel per local head count, lengths and mask; built once and reused.

    The kernel creates its block-sparsity tables as device arrays when it is built. Built in
    the trace, under a mesh of TPU devices this host does not have (compiling for a target),
    placing them fails; so it is built on a fresh thread, where jax has no mesh and no trace
    (both are per thread), and the trace closes over the tables as host constants.
    """
    return on_fresh_thread(_build_kernel, heads, T, S, causal, window, interpret)


def on_fresh_thread(build, *args):
    """`build(*args)` on a new thread: no mesh, no trace (see `_kernel`)."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(build, *args).result()


def _build_kernel(heads, T, S, causal, window, interpret):
    if window is not None:
        # w visible tokens: the query and w-1 before it; with causal nothing after it.
        mask = masks.LocalMask((T, S), (window - 1, 0 if causal else None), offset=0)
    elif causal:
        mask = masks.CausalMask((T, S))
    else:
        mask = masks.FullMask((T, S))
    return mha_kernel(mask, heads, T, S, interpret=interpret)


def mha_kernel(mask, heads: int, T: int, S: int, *, interpret: bool, save_residuals=False):
    """splash's multi-head kernel: `mask` ([T, S]) on every head, tiles of `block_size`."""
    bq, bkv = block_size(T), block_size(S)
    blocks = splash.BlockSizes(
        block_q=bq,
        block_kv=bkv,
        block_kv_compute=bkv,
        block_q_dkv=bq,
        block_kv_dkv=bkv,
        block_kv_dkv_compute=bkv,
        block_q_dq=bq,
        block_kv_dq=bkv,
    )
    return splash.make_splash_mha(
        masks.MultiHeadMask([mask] * heads),
        block_sizes=blocks,
        head_shards=1,
        q_seq_shards=1,
        save_residuals=save_residuals,
        interpret=interpret,
    )


def splash_attention(
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
    """Local (per-device) splash attention; GQA/MQA by fewer kv heads, as the kernel takes.
    `sinks` ([N], this device's heads): the kernel's own attention-sink input, compared with
    the logits after the scale (q is pre-scaled), as transformers adds them."""
    del out_sharding  # runs inside shard_map; the dispatcher gives the output its layout
    _, T, N, _ = q_BTND.shape
    S = k_BSKD.shape[1]
    kernel = _kernel(N, T, S, bool(causal), static_window(sliding_window), bool(interpret))
    # The kernel has no scale argument: scale q (each family's own softmax scale).
    q_BNTD = jnp.swapaxes(q_BTND * jnp.asarray(scale, q_BTND.dtype), 1, 2)
    k_BKSD = jnp.swapaxes(k_BSKD, 1, 2)
    v_BKSD = jnp.swapaxes(v_BSKD, 1, 2)

    extra = {} if sinks is None else {"sinks": sinks.astype(jnp.float32)}

    def one_row(q_NTD, k_KSD, v_KSD, q_ids_T, kv_ids_S):
        ids = splash.SegmentIds(q=q_ids_T, kv=kv_ids_S)
        return kernel(q_NTD, k_KSD, v_KSD, segment_ids=ids, **extra)

    out_BNTD = jax.vmap(one_row)(q_BNTD, k_BKSD, v_BKSD, segments.q_ids_BT, segments.kv_ids_BS)
    return jnp.swapaxes(out_BNTD, 1, 2)


register_backend(
    "splash",
    splash_attention,
    keeps_layout=False,
    equal_lengths=True,
    static_window=True,
    unavailable=unavailable,
    sinks=True,
)
