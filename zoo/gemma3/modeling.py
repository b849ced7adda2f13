"""Gemma 3 (text): (1 + w) RMSNorms before and after each sub-block, q/k norms, GeGLU,
embeddings scaled by sqrt(M), local (sliding, own RoPE base) and global layers interleaved,
and optionally soft-capped logits. Every module is the shared one from zoo/layers/."""

from __future__ import annotations

import dataclasses

from zoo.layers.config import DecoderConfig
from zoo.layers.decoder import DecoderLM
from zoo.registry import preset_table


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


class Gemma3(DecoderLM):
    """The shared decoder; every Gemma feature is a `Gemma3Config` knob."""


# query_pre_attn_scalar is the head dim, 256: queries scale by 256**-0.5.
_1B = {"sliding_window": 512, "attn_scale": 256**-0.5}
# rope_scaling: linear, on the global layers only.
_4B = {"sliding_window": 1024, "attn_scale": 256**-0.5, "rope_scaling": (8.0,)}
PRESETS = preset_table(
    Gemma3Config,
    {
        # V, M, L, N, K, D, F, T (zoo.registry.PRESET_DIMS), then the other fields.
        "gemma3-1b": (262_144, 1152, 26, 4, 1, 256, 6912, 32_768, _1B),
        "gemma3-4b": (262_208, 2560, 34, 8, 4, 256, 10_240, 131_072, _4B),
    },
)
