"""Gemma 3 (text): (1 + w) RMSNorms before and after each sub-block, q/k norms, GeGLU,
embeddings scaled by sqrt(M), local (sliding, own RoPE base) and global layers interleaved,
and optionally soft-capped logits. Every module is the shared one from zoo/layers/."""

from __future__ import annotations

import dataclasses

from zoo.layers.config import DecoderConfig
from zoo.layers.decoder import DecoderLM


@dataclasses.dataclass(frozen=True, kw_only=True)
class Gemma3Config(DecoderConfig):
    norm_eps: float = 1e-6
    norm_plus_one: bool = True
    qk_norm: bool = True
    post_norms: bool = True
    activation: str = "gelu_tanh"
    embed_scale: bool = True
    tie_embeddings: bool = True
    rope_theta: float = 1_000_000.0
    rope_local_theta: float | None = 10_000.0
    global_every: int = 6  # five local layers, then one global

    @classmethod
    def gemma3_1b(cls, **overrides) -> Gemma3Config:
        base = dict(
            vocab_size=262_144,
            hidden_dim=1152,
            num_layers=26,
            num_heads=4,
            num_kv_heads=1,
            head_dim=256,
            ffn_dim=6912,
            max_seq_len=32_768,
            sliding_window=512,
            attn_scale=256**-0.5,  # query_pre_attn_scalar
        )
        return cls(**{**base, **overrides})

    @classmethod
    def gemma3_4b(cls, **overrides) -> Gemma3Config:
        base = dict(
            vocab_size=262_208,
            hidden_dim=2560,
            num_layers=34,
            num_heads=8,
            num_kv_heads=4,
            head_dim=256,
            ffn_dim=10_240,
            max_seq_len=131_072,
            sliding_window=1024,
            attn_scale=256**-0.5,
            rope_scaling=(8.0,),  # linear, on the global layers only
        )
        return cls(**{**base, **overrides})


class Gemma3(DecoderLM):
    """The shared decoder; every Gemma feature is a `Gemma3Config` knob."""


PRESETS = {"gemma3-1b": Gemma3Config.gemma3_1b, "gemma3-4b": Gemma3Config.gemma3_4b}
