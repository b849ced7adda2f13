"""Mistral: Llama with sliding-window attention on every layer. Every module is the shared
one from zoo/layers/."""

from __future__ import annotations

import dataclasses

from zoo.layers.config import DecoderConfig
from zoo.layers.decoder import DecoderLM
from zoo.registry import preset_table


@dataclasses.dataclass(frozen=True, kw_only=True)
class MistralConfig(DecoderConfig):
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    # Tokens a query sees, itself included: HF's `sliding_window` counts the same way.
    sliding_window: int | None = 4096


class Mistral(DecoderLM):
    """The shared decoder; `MistralConfig.sliding_window` windows every layer."""


PRESETS = preset_table(
    MistralConfig,
    {
        # V, M, L, N, K, D, F, T (zoo.registry.PRESET_DIMS), then the other fields.
        "mistral-7b-v0.1": (32_000, 4096, 32, 32, 8, 128, 14_336, 32_768, {"sliding_window": 4096}),
    },
)
