"""Qwen3 (dense): Llama with a per-head RMSNorm on q and k before RoPE, and a head dim that
need not be M / N. Every module is the shared one from zoo/layers/."""

from __future__ import annotations

import dataclasses

from zoo.layers.config import DecoderConfig
from zoo.layers.decoder import DecoderLM
from zoo.registry import preset_table


@dataclasses.dataclass(frozen=True, kw_only=True)
class Qwen3Config(DecoderConfig):
    rope_theta: float = 1_000_000.0
    norm_eps: float = 1e-6
    qk_norm: bool = True


class Qwen3(DecoderLM):
    """The shared decoder; `Qwen3Config.qk_norm` adds the q/k norms."""


# The 152K vocabulary, head dim 128 and a 40K context of every Qwen3 (Qwen/Qwen3-* config.json).
_TIED = {"tie_embeddings": True}
PRESETS = preset_table(
    Qwen3Config,
    {
        # V, M, L, N, K, D, F, T (zoo.registry.PRESET_DIMS), then the other fields.
        "qwen3-0.6b": (151_936, 1024, 28, 16, 8, 128, 3072, 40_960, _TIED),
        "qwen3-1.7b": (151_936, 2048, 28, 16, 8, 128, 6144, 40_960, _TIED),
        "qwen3-4b": (151_936, 2560, 36, 32, 8, 128, 9728, 40_960, _TIED),
        "qwen3-8b": (151_936, 4096, 36, 32, 8, 128, 12_288, 40_960, {"tie_embeddings": False}),
    },
)
