"""The `cudnn` backend: cuDNN fused (flash) attention through jax.nn.dot_product_attention.

Two forms of the same public call, chosen by what the rows hold (Segments.packed):

- unpacked rows (one document from index 0, then padding; eval batches, training with one
  document per row): `query_seq_lengths` / `key_value_seq_lengths` and the causal mask type.
  No mask tensor at all.
- packed rows (several documents per row, the default training data path): the document mask
  as `mask=`, a boolean [B, 1, T, S] that jax turns into an additive bias for the fused kernel,
  with `is_causal` still set so cuDNN skips the blocks above the diagonal.

Why the bias and not the Pallas GPU `mha` kernel (which takes segment ids): `mha` has no GQA
(k/v would have to be repeated to N heads before the call, N/K times their memory) and no
sliding window, so it would cover fewer of the zoo's families; the bias is one head-broadcast
[B, 1, T, S] mask per device instead of xla's [B, N, T, S] float32 scores. Compiled for 8 x
H100 (tiny model, fsdp_tp (4, 2), bf16, batch 8 x 128), the train step's temp memory is
2.09 MB per device with this path against 4.91 MB with xla, with `__cudnn$fmhaScaleBiasSoftmax`
forward and backward in the HLO; bench/attention_memory.py prints the figures for real sizes.

cuDNN's own limits (platform, dtype, head dim) are checked before tracing (`unavailable`), so
an explicit request that cannot run is one clear error instead of jax's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from zoo.layers.attention.mask import Segments, attention_mask, is_static, static_window
from zoo.layers.attention.registry import register_backend

# jax reports NVIDIA GPUs as 'gpu' (and the plugin as 'cuda' in some builds).
GPU_PLATFORMS = ("gpu", "cuda")
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# cuDNN flash attention: head dim a multiple of 8, at most 128 before Hopper and 256 on it.
# `auto` keeps to 128 (safe on every generation); an explicit 'cudnn' allows up to 256 and
# leaves the pre-Hopper case to jax's own check.
AUTO_MAX_HEAD_DIM = 128
MAX_HEAD_DIM = 256


def unavailable(call) -> str | None:
    """Why cuDNN cannot run this call here (see registry.CallInfo), or None."""
    if call.platform not in GPU_PLATFORMS:
        return f"needs an NVIDIA GPU with cuDNN; this process compiles for {call.platform}"
    if jnp.dtype(call.dtype) not in _DTYPES:
        return f"needs bfloat16 or float16 inputs, got {jnp.dtype(call.dtype).name}"
    limit = AUTO_MAX_HEAD_DIM if call.auto else MAX_HEAD_DIM
    if call.head_dim % 8 or call.head_dim > limit:
        return f"needs a head dim that is a multiple of 8 and <= {limit}, got {call.head_dim}"
    return None


def cudnn_attention(
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
    jax_implementation: str = "cudnn",
):
    """Local (per-device) cuDNN attention. `jax_implementation='xla'` runs the very same
    arguments through jax's reference path: tests use it to check the translation on CPU."""
    del out_sharding, interpret  # the dispatcher restores the layout; no interpret mode
    window = static_window(sliding_window) if is_static(sliding_window) else None
    kwargs = dict(scale=scale, is_causal=causal, implementation=jax_implementation)
    if window is not None:
        # jax's (left, right) counts tokens besides the query: w visible = w - 1 to the left.
        kwargs["local_window_size"] = (window - 1, 0)
    if segments.packed or not is_static(sliding_window):
        # The mask holds documents, causality by position, and a traced window if any.
        mask_BTS = attention_mask(segments, causal=causal, sliding_window=sliding_window)
        return jax.nn.dot_product_attention(
            q_BTND, k_BSKD, v_BSKD, mask=mask_BTS[:, None], **kwargs
        )
    q_len_B = jnp.sum(segments.q_ids_BT != 0, axis=1, dtype=jnp.int32)
    kv_len_B = jnp.sum(segments.kv_ids_BS != 0, axis=1, dtype=jnp.int32)
    return jax.nn.dot_product_attention(
        q_BTND,
        k_BSKD,
        v_BSKD,
        query_seq_lengths=q_len_B,
        key_value_seq_lengths=kv_len_B,
        **kwargs,
    )


register_backend(
    "cudnn",
    cudnn_attention,
    keeps_layout=False,
    equal_lengths=True,
    unavailable=unavailable,
)
