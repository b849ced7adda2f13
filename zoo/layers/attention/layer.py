"""The attention module: q/k/v/o projections, optional q/k norms, RoPE, KV cache.

The attention arithmetic itself (XLA, cuDNN, layout restoring) is `dispatch.attention`.
"""

from __future__ import annotations

import jax
from flax import nnx

from shardings.specs import AttentionSharding
from zoo.layers import kv_cache, remat, rope
from zoo.layers.attention import context_parallel, dispatch
from zoo.layers.attention.mask import Segments
from zoo.layers.basic import Einsum, Norm, _normal, projection_options


class Attention(nnx.Module):
    def __init__(self, cfg, sharding: AttentionSharding, *, rngs: nnx.Rngs):
        M, N, K, D = cfg.hidden_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.sharding = sharding
        self.scale = cfg.softmax_scale
        self.use_rope = cfg.position == "rope"
        self.implementation = cfg.attention_impl
        self.interpret = cfg.attention_interpret
        self.context_parallel = cfg.context_parallel
        common = projection_options(cfg, rngs)
        if cfg.attention_bias:  # GPT-OSS: biases on q/k/v/o, none elsewhere
            common["use_bias"] = True
        self.q = Einsum("BTM,MND->BTND", (M, N, D), sharding.q, **common)
        self.k = Einsum("BTM,MKD->BTKD", (M, K, D), sharding.k, **common)
        self.v = Einsum("BTM,MKD->BTKD", (M, K, D), sharding.v, **common)
        self.o = Einsum("BTND,NDM->BTM", (N, D, M), sharding.o, **common)
        if cfg.qk_norm:
            norm = dict(eps=cfg.norm_eps, plus_one=cfg.norm_plus_one, dtype=cfg.compute_dtype)
            self.q_norm = Norm(D, sharding.q_norm, **norm)
            self.k_norm = Norm(D, sharding.k_norm, **norm)
        else:
            self.q_norm = self.k_norm = None
        # GPT-OSS's attention sinks: one logit per query head (dispatch.attention's `sinks`).
        self.sinks = (
            nnx.Param(_normal(rngs, (N,), sharding.sinks), out_sharding=sharding.sinks)
            if cfg.attention_sinks
            else None
        )

    def __call__(self, x_BTM, segments: Segments, *, window, inv_freq_R, kv=None):
        """`segments`: this call's tokens (ids, positions, whether rows are packed). `kv`:
        None, or this layer's `LayerCache`, into which this step's keys and values are
        written at `kv.index`. Returns (out_BTM, kv'), kv' None when kv is."""
        segment_ids_BT, positions_BT = segments.q_ids_BT, segments.q_positions_BT
        with jax.named_scope("qkv_proj"):
            q_BTND = remat.tag(self.q(x_BTM), remat.Q_PROJ)
            k_BTKD = remat.tag(self.k(x_BTM), remat.K_PROJ)
            v_BTKD = remat.tag(self.v(x_BTM), remat.V_PROJ)
        if self.q_norm is not None:
            q_BTND, k_BTKD = self.q_norm(q_BTND), self.k_norm(k_BTKD)
        if self.use_rope:
            q_BTND = rope.rotate(q_BTND, positions_BT, inv_freq_R)
            k_BTKD = rope.rotate(k_BTKD, positions_BT, inv_freq_R)
        q_BTND = remat.tag(q_BTND, remat.Q_ROTATED)
        k_BTKD = remat.tag(k_BTKD, remat.K_ROTATED)
        if kv is not None:
            # Keys are the cache's slots; earlier prompts sit in it: rows count as packed.
            segments = Segments(segment_ids_BT, kv.segment_ids, positions_BT, kv.positions)
            k_BTKD = kv_cache.write(kv.k, k_BTKD.astype(kv.k.dtype), kv.index)
            v_BTKD = kv_cache.write(kv.v, v_BTKD.astype(kv.v.dtype), kv.index)
            kv = kv._replace(k=k_BTKD, v=v_BTKD)
        # --- context-parallel hook: T split over a mesh axis (training / eval forward) ---
        cp_axis = context_parallel.seq_axis(self.sharding.q.out) if kv is None else None
        sinks = None if self.sinks is None else self.sinks[...]
        if cp_axis is not None:
            out_BTND = context_parallel.attention(
                q_BTND,
                k_BTKD,
                v_BTKD,
                segment_ids_BT=segment_ids_BT,
                positions_BT=positions_BT,
                axis=cp_axis,
                scale=self.scale,
                sliding_window=window,
                implementation=self.implementation,
                out_sharding=self.sharding.q.out,
                method=self.context_parallel,
                interpret=self.interpret,
                sinks=sinks,
            )
            return self._out(out_BTND), kv
        # --- end of hook ---
        out_BTND = dispatch.attention(
            q_BTND,
            k_BTKD,
            v_BTKD,
            segments,
            scale=self.scale,
            out_sharding=self.sharding.q.out,
            causal=True,
            sliding_window=window,
            implementation=self.implementation,
            interpret=self.interpret,
            site=None if kv is None else "attention over a KV cache",
            sinks=sinks,
        )
        return self._out(out_BTND), kv

    def _out(self, out_BTND):
        with jax.named_scope("out_proj"):
            return remat.tag(self.o(out_BTND), remat.OUT_PROJ)
