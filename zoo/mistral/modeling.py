"""Mistral: Llama with sliding-window attention on every layer. Every module is the shared
one from zoo/layers/."""

from __future__ import annotations

import dataclasses

from zoo.layers.config import DecoderConfig
from zoo.layers.decoder import DecoderLM


@dataclasses.dataclass(frozen=True, kw_only=True)
class MistralConfig(DecoderConfig):
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    # Tokens a query sees, itself included: HF's `sliding_window` counts the same way.
    sliding_window: int | None = 4096

    @classmethod
    def mistral_7b_v0_1(cls, **overrides) -> MistralConfig:
        base = dict(
            vocab_size=32_000,
            hidden_dim=4096,
            num_layers=32,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            ffn_dim=14_336,
            max_seq_len=32_768,
            sliding_window=4096,
        )
        return cls(**{**base, **overrides})


class Mistral(DecoderLM):
    """The shared decoder; `MistralConfig.sliding_window` windows every layer."""


PRESETS = {"mistral-7b-v0.1": MistralConfig.mistral_7b_v0_1}
