"""GPT-2: learned positions, LayerNorm with biases, biases on every projection, a plain
(ungated) GELU MLP, multi-head attention, tied head. Every module is the shared one from
zoo/layers/; GPT-2's fused qkv projection is split into q/k/v at load time (params.py)."""

from __future__ import annotations

import dataclasses

from zoo.layers.config import DecoderConfig
from zoo.layers.decoder import DecoderLM
from zoo.registry import preset_table


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPT2Config(DecoderConfig):
    norm: str = "layer"
    norm_eps: float = 1e-5
    use_bias: bool = True
    activation: str = "gelu_tanh"  # HF's gelu_new
    glu: bool = False
    position: str = "learned"  # a [max_seq_len, M] table: max_seq_len is n_positions
    tie_embeddings: bool = True


class GPT2(DecoderLM):
    """The shared decoder with `position='learned'`, `norm='layer'`, `use_bias`, `glu=False`."""


PRESETS = preset_table(
    GPT2Config,
    {
        # V, M, L, N, K, D, F, T (zoo.registry.PRESET_DIMS); T is n_positions.
        "gpt2": (50_257, 768, 12, 12, 12, 64, 3072, 1024),  # GPT-2 small, 124M
        "gpt2-medium": (50_257, 1024, 24, 16, 16, 64, 4096, 1024),  # 355M
    },
)
