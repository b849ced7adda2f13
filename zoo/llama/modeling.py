"""Llama 3.x (and 2): RMSNorm, RoPE with Llama 3 frequency scaling, grouped-query attention,
SwiGLU.

Every module is the shared one from zoo/layers/; the family is its config and presets.
"""

from __future__ import annotations

import dataclasses

from zoo.layers.config import DecoderConfig
from zoo.layers.decoder import DecoderLM
from zoo.registry import preset_table

# Llama 3.1 / 3.2 RoPE scaling: (factor, low_freq_factor, high_freq_factor, original context).
LLAMA31_SCALING = (8.0, 1.0, 4.0, 8192)
LLAMA32_SCALING = (32.0, 1.0, 4.0, 8192)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig(DecoderConfig):
    rope_theta: float = 500_000.0
    norm_eps: float = 1e-5


class Llama(DecoderLM):
    pass


# Every Llama 3.x: the 128K tokenizer, 8 kv heads, a 128K context (meta-llama config.json).
# Llama 2: the 32K SentencePiece vocabulary, RoPE base 10000 unscaled, a 4K context.
_L31 = {"rope_scaling": LLAMA31_SCALING}
_L32 = {"rope_scaling": LLAMA32_SCALING, "tie_embeddings": True}
_L2 = {"rope_theta": 10_000.0}
PRESETS = preset_table(
    LlamaConfig,
    {
        # V, M, L, N, K, D, F, T (zoo.registry.PRESET_DIMS), then the other fields.
        # tiny, for tests: GQA, every dim divisible by 8 devices' splits.
        "tiny": (512, 64, 2, 8, 4, 16, 128, 256, {"rope_theta": 10_000.0}),
        "llama3.2-1b": (128_256, 2048, 16, 32, 8, 64, 8192, 131_072, _L32),
        "llama3.2-3b": (128_256, 3072, 28, 24, 8, 128, 8192, 131_072, _L32),
        "llama3.1-8b": (128_256, 4096, 32, 32, 8, 128, 14_336, 131_072, _L31),
        "llama3.1-70b": (128_256, 8192, 80, 64, 8, 128, 28_672, 131_072, _L31),
        "llama2-7b": (32_000, 4096, 32, 32, 32, 128, 11_008, 4096, _L2),  # MHA
        "llama2-70b": (32_000, 8192, 80, 64, 8, 128, 28_672, 4096, _L2),
    },
)
