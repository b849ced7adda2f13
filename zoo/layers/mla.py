"""Multi-head latent attention (DeepSeek-V2/V3), as transformers' `DeepseekV3Attention`.

Dims: M residual, N heads, Q the query latent (q_lora_rank), C the key/value latent
(kv_lora_rank), d the non-rotary q/k dims per head (qk_nope_head_dim), r the rotary ones
(qk_rope_head_dim), D = d + r, Dv the value dims (v_head_dim).

- queries: x -> q_a [M, Q] -> RMSNorm -> q_b [Q, N, D] (or one [M, N, D] projection when
  q_lora_rank is 0); each head's last r dims are rotated;
- keys and values: x -> kv_a [M, C + r]: the latent (C, RMS-normed) and one rotary key of r
  dims shared by every head; kv_b [C, N, d + Dv] expands the latent to each head's
  non-rotary key and its value; a head's key is (its d dims, the shared rotated r dims);
- softmax scale (d + r) ** -0.5, times mscale(factor, mscale_all_dim) ** 2 under YaRN.

Rotary dims: DeepSeek's checkpoints lay q's and k's r dims out as interleaved pairs
(`rope_interleave`), rotated pair by pair; transformers de-interleaves them (evens, then odds)
and rotates half against half, which is the half-split rotation (zoo/layers/rope.py) of the
de-interleaved dims. Queries and keys are permuted alike, so the logits are the same.

The KV cache keeps what kv_a makes per token: the normed latent [B, S, 1, C] and the rotated
shared key [B, S, 1, r] (`KVCache.k` and `.v`), C + r numbers a token and layer (576 for
DeepSeek-V3 against 2 * N * D = 49152 for its expanded keys and values); each step expands
the cache through kv_b, as transformers does.

The attention core is the dispatcher's with keys of D dims and values of Dv: values are
padded with zeros to D and the output's padding columns dropped (exact). Only the xla backend
runs it: splash and cuDNN are refused by name (they would run the padded D, which neither
is checked for here), and `auto` picks xla, which the attention record says.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnx_zoo.errors import UsageError
from shardings.specs import MlaSharding
from zoo.layers import kv_cache, remat, rope
from zoo.layers.attention import choices, context_parallel, dispatch
from zoo.layers.attention.mask import Segments
from zoo.layers.basic import Einsum, Norm, projection_options

WHY_XLA = "multi-head latent attention runs on xla (its values are narrower than q/k heads)"


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature (arXiv 2309.00071, eq. 21), as transformers computes it."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_frequencies(dim: int, theta: float, yarn: tuple) -> tuple[np.ndarray, float]:
    """([dim/2] inverse frequencies, the factor on cos/sin) of YaRN, as transformers'
    `_compute_yarn_parameters` (truncated correction range). `yarn`: (factor,
    original_max_position_embeddings, beta_fast, beta_slow, mscale, mscale_all_dim), the
    last two 0 when absent."""
    factor, original, beta_fast, beta_slow, mscale, mscale_all_dim = yarn
    if mscale and mscale_all_dim:
        attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    else:
        attention_factor = yarn_mscale(factor)

    def correction_dim(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    # float32 arithmetic, as transformers' torch code, so the frequencies agree to the bit.
    pos_freqs = np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    extrapolation = np.float32(1.0) / pos_freqs
    interpolation = np.float32(1.0) / (np.float32(factor) * pos_freqs)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = np.float32(1.0) - ramp.astype(np.float32)
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq.astype(np.float32), float(attention_factor)


def rope_frequencies(cfg) -> tuple[np.ndarray, float]:
    """(inverse frequencies [r/2], cos/sin factor) of an MLA config's rotary dims."""
    r = cfg.qk_rope_head_dim
    if cfg.rope_yarn is not None:
        return yarn_frequencies(r, cfg.rope_theta, cfg.rope_yarn)
    return rope.inverse_frequencies(r, cfg.rope_theta), 1.0


def softmax_scale(cfg) -> float:
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    if cfg.rope_yarn is not None and cfg.rope_yarn[5]:
        scale *= yarn_mscale(cfg.rope_yarn[0], cfg.rope_yarn[5]) ** 2
    return scale


class MultiHeadLatentAttention(nnx.Module):
    def __init__(self, cfg, sharding: MlaSharding, *, rngs: nnx.Rngs):
        M, N = cfg.hidden_dim, cfg.num_heads
        d, r, Dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        Q, C = cfg.q_lora_rank, cfg.kv_lora_rank
        if cfg.attention_impl not in ("xla", "auto"):
            raise UsageError(
                f"attention_impl={cfg.attention_impl!r}: {WHY_XLA}; use attention_impl=xla or auto"
            )
        self.sharding = sharding
        self.dims = (d, r, Dv)
        self.scale = softmax_scale(cfg)
        self.rope_factor = rope_frequencies(cfg)[1]
        self.interleaved = cfg.rope_interleave
        self.implementation = cfg.attention_impl
        common = projection_options(cfg, rngs)
        norm = dict(eps=cfg.norm_eps, dtype=cfg.compute_dtype)
        D = d + r
        if Q:
            self.q = None
            self.q_a = Einsum("BTM,MQ->BTQ", (M, Q), sharding.q_a, **common)
            self.q_a_norm = Norm(Q, sharding.q_a_norm, **norm)
            self.q_b = Einsum("BTQ,QND->BTND", (Q, N, D), sharding.q_b, **common)
        else:
            self.q = Einsum("BTM,MND->BTND", (M, N, D), sharding.q, **common)
            self.q_a = self.q_a_norm = self.q_b = None
        self.kv_a = Einsum("BTM,MC->BTC", (M, C + r), sharding.kv_a, **common)
        self.kv_a_norm = Norm(C, sharding.kv_a_norm, **norm)
        self.kv_b = Einsum("BSC,CND->BSND", (C, N, d + Dv), sharding.kv_b, **common)
        self.o = Einsum("BTND,NDM->BTM", (N, Dv, M), sharding.o, **common)

    def _rotate(self, x_BTHr, positions_BT, inv_freq_R):
        if self.interleaved:
            x_BTHr = jnp.concatenate([x_BTHr[..., 0::2], x_BTHr[..., 1::2]], axis=-1)
        out = rope.rotate(x_BTHr, positions_BT, inv_freq_R)
        if self.rope_factor != 1.0:
            out = out * jnp.asarray(self.rope_factor, out.dtype)
        return out

    def __call__(self, x_BTM, segments: Segments, *, window, inv_freq_R, kv=None):
        """As `Attention.__call__`; `kv.k` / `kv.v` hold the latent and the rotary key."""
        del window  # MLA models attend globally
        d, r, Dv = self.dims
        s = self.sharding
        if context_parallel.seq_axis(s.heads) is not None:
            raise UsageError(
                "multi-head latent attention does not split T over a mesh axis (context "
                "parallelism); use a strategy without `context`, e.g. fsdp_ep"
            )
        positions_BT = segments.q_positions_BT
        with jax.named_scope("qkv_proj"):
            if self.q is not None:
                q_BTND = self.q(x_BTM)
            else:
                q_BTND = self.q_b(self.q_a_norm(self.q_a(x_BTM)))
            q_BTND = remat.tag(q_BTND, remat.Q_PROJ)
            c_BTC = self.kv_a(x_BTM)
            latent_BTC = self.kv_a_norm(c_BTC[..., :-r])
            k_rope_BT1r = c_BTC[..., None, -r:]
        q_rope_BTNr = self._rotate(q_BTND[..., d:], positions_BT, inv_freq_R)
        q_BTND = jnp.concatenate([q_BTND[..., :d], q_rope_BTNr], axis=-1)
        k_rope_BT1r = self._rotate(k_rope_BT1r, positions_BT, inv_freq_R)
        latent_BT1C = latent_BTC[:, :, None, :]
        if kv is not None:
            # The cache keeps the latent and the rotated shared key; every step expands it.
            segments = Segments(segments.q_ids_BT, kv.segment_ids, positions_BT, kv.positions)
            latent_BT1C = kv_cache.write(kv.k, latent_BT1C.astype(kv.k.dtype), kv.index)
            k_rope_BT1r = kv_cache.write(kv.v, k_rope_BT1r.astype(kv.v.dtype), kv.index)
            kv = kv._replace(k=latent_BT1C, v=k_rope_BT1r)
        dtype = q_BTND.dtype
        with jax.named_scope("kv_expand"):
            kv_BSNE = self.kv_b(latent_BT1C[:, :, 0, :].astype(dtype))
            k_nope_BSNd, v_BSNv = kv_BSNE[..., :d], kv_BSNE[..., d:]
            # The shared rotary key joins every head's key (broadcast over N).
            k_rope_BSNr = k_rope_BT1r.astype(dtype) + jnp.zeros_like(k_nope_BSNd[..., :1])
            k_BSND = jnp.concatenate([k_nope_BSNd, k_rope_BSNr], axis=-1)
            v_BSND = jnp.pad(v_BSNv, ((0, 0), (0, 0), (0, 0), (0, d + r - Dv)))
        q_BTND = remat.tag(q_BTND, remat.Q_ROTATED)
        k_BSND = remat.tag(k_BSND, remat.K_ROTATED)
        if self.implementation == "auto":
            call = choices.describe_call(
                q_BTND, k_BSND, segments, causal=True, sliding_window=None, site=self._site(kv)
            )
            choices.record(choices.Choice(call, "auto", "xla", f"auto: {WHY_XLA}"))
        out_BTND = dispatch.attention(
            q_BTND,
            k_BSND,
            v_BSND,
            segments,
            scale=self.scale,
            out_sharding=s.heads,
            causal=True,
            sliding_window=None,
            implementation="xla",
            site=self._site(kv),
        )
        with jax.named_scope("out_proj"):
            return remat.tag(self.o(out_BTND[..., :Dv]), remat.OUT_PROJ), kv

    @staticmethod
    def _site(kv) -> str:
        return "latent attention" if kv is None else "latent attention over a KV cache"
