"""Qwen3 (dense): Llama with a per-head RMSNorm on q and k before RoPE, and a head dim that
need not be M / N. Every module is the shared one from zoo/layers/."""

from __future__ import annotations

import dataclasses

from zoo.layers.config import DecoderConfig
from zoo.layers.decoder import DecoderLM


@dataclasses.dataclass(frozen=True, kw_only=True)
class Qwen3Config(DecoderConfig):
    rope_theta: float = 1_000_000.0
    norm_eps: float = 1e-6
    qk_norm: bool = True

    @classmethod
    def _preset(cls, overrides, **base) -> Qwen3Config:
        common = dict(vocab_size=151_936, head_dim=128, max_seq_len=40_960)
        return cls(**{**common, **base, **overrides})

    @classmethod
    def qwen3_0_6b(cls, **overrides) -> Qwen3Config:
        return cls._preset(
            overrides,
            hidden_dim=1024,
            num_layers=28,
            num_heads=16,
            num_kv_heads=8,
            ffn_dim=3072,
            tie_embeddings=True,
        )

    @classmethod
    def qwen3_1_7b(cls, **overrides) -> Qwen3Config:
        return cls._preset(
            overrides,
            hidden_dim=2048,
            num_layers=28,
            num_heads=16,
            num_kv_heads=8,
            ffn_dim=6144,
            tie_embeddings=True,
        )

    @classmethod
    def qwen3_4b(cls, **overrides) -> Qwen3Config:
        return cls._preset(
            overrides,
            hidden_dim=2560,
            num_layers=36,
            num_heads=32,
            num_kv_heads=8,
            ffn_dim=9728,
            tie_embeddings=True,
        )

    @classmethod
    def qwen3_8b(cls, **overrides) -> Qwen3Config:
        return cls._preset(
            overrides,
            hidden_dim=4096,
            num_layers=36,
            num_heads=32,
            num_kv_heads=8,
            ffn_dim=12_288,
            tie_embeddings=False,
        )


class Qwen3(DecoderLM):
    """The shared decoder; `Qwen3Config.qk_norm` adds the q/k norms."""


PRESETS = {
    "qwen3-0.6b": Qwen3Config.qwen3_0_6b,
    "qwen3-1.7b": Qwen3Config.qwen3_1_7b,
    "qwen3-4b": Qwen3Config.qwen3_4b,
    "qwen3-8b": Qwen3Config.qwen3_8b,
}
