"""Llama 3.x: RMSNorm, RoPE with Llama 3 frequency scaling, grouped-query attention, SwiGLU.

Every module is the shared one from zoo/layers/; the family is its config and presets.
"""

from __future__ import annotations

import dataclasses

from zoo.layers.config import DecoderConfig
from zoo.layers.decoder import DecoderLM

# Llama 3.1 / 3.2 RoPE scaling: (factor, low_freq_factor, high_freq_factor, original context).
LLAMA31_SCALING = (8.0, 1.0, 4.0, 8192)
LLAMA32_SCALING = (32.0, 1.0, 4.0, 8192)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig(DecoderConfig):
    rope_theta: float = 500_000.0
    norm_eps: float = 1e-5

    @classmethod
    def tiny(cls, **overrides) -> LlamaConfig:
        """For tests: GQA (8 heads, 4 kv heads), every dim divisible by 8 devices' splits."""
        base = dict(
            vocab_size=512,
            hidden_dim=64,
            num_layers=2,
            num_heads=8,
            num_kv_heads=4,
            head_dim=16,
            ffn_dim=128,
            max_seq_len=256,
            rope_theta=10_000.0,
        )
        return cls(**{**base, **overrides})

    @classmethod
    def _llama3(cls, overrides, **base) -> LlamaConfig:
        # Every Llama 3.x: the 128K tokenizer, 8 kv heads and a 128K context.
        common = dict(vocab_size=128_256, num_kv_heads=8, max_seq_len=131_072)
        return cls(**{**common, **base, **overrides})

    @classmethod
    def llama3_2_1b(cls, **overrides) -> LlamaConfig:
        return cls._llama3(
            overrides,
            hidden_dim=2048,
            num_layers=16,
            num_heads=32,
            head_dim=64,
            ffn_dim=8192,
            rope_scaling=LLAMA32_SCALING,
            tie_embeddings=True,
        )

    @classmethod
    def llama3_2_3b(cls, **overrides) -> LlamaConfig:
        return cls._llama3(
            overrides,
            hidden_dim=3072,
            num_layers=28,
            num_heads=24,
            head_dim=128,
            ffn_dim=8192,
            rope_scaling=LLAMA32_SCALING,
            tie_embeddings=True,
        )

    @classmethod
    def llama3_1_8b(cls, **overrides) -> LlamaConfig:
        return cls._llama3(
            overrides,
            hidden_dim=4096,
            num_layers=32,
            num_heads=32,
            head_dim=128,
            ffn_dim=14_336,
            rope_scaling=LLAMA31_SCALING,
        )

    @classmethod
    def llama3_1_70b(cls, **overrides) -> LlamaConfig:
        # meta-llama/Llama-3.1-70B config.json.
        return cls._llama3(
            overrides,
            hidden_dim=8192,
            num_layers=80,
            num_heads=64,
            head_dim=128,
            ffn_dim=28_672,
            rope_scaling=LLAMA31_SCALING,
        )

    @classmethod
    def _llama2(cls, overrides, **base) -> LlamaConfig:
        # Llama 2: the 32K SentencePiece vocabulary, RoPE base 10000 unscaled, 4K context.
        common = dict(vocab_size=32_000, rope_theta=10_000.0, max_seq_len=4096)
        return cls(**{**common, **base, **overrides})

    @classmethod
    def llama2_7b(cls, **overrides) -> LlamaConfig:
        # MHA (32 kv heads); meta-llama/Llama-2-7b-hf config.json.
        return cls._llama2(
            overrides,
            hidden_dim=4096,
            num_layers=32,
            num_heads=32,
            num_kv_heads=32,
            head_dim=128,
            ffn_dim=11_008,
        )

    @classmethod
    def llama2_70b(cls, **overrides) -> LlamaConfig:
        # GQA with 8 kv heads; meta-llama/Llama-2-70b-hf config.json.
        return cls._llama2(
            overrides,
            hidden_dim=8192,
            num_layers=80,
            num_heads=64,
            num_kv_heads=8,
            head_dim=128,
            ffn_dim=28_672,
        )


class Llama(DecoderLM):
    pass


PRESETS = {
    "tiny": LlamaConfig.tiny,
    "llama3.2-1b": LlamaConfig.llama3_2_1b,
    "llama3.2-3b": LlamaConfig.llama3_2_3b,
    "llama3.1-8b": LlamaConfig.llama3_1_8b,
    "llama3.1-70b": LlamaConfig.llama3_1_70b,
    "llama2-7b": LlamaConfig.llama2_7b,
    "llama2-70b": LlamaConfig.llama2_70b,
}
