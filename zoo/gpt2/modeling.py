"""GPT-2: learned positions, LayerNorm with biases, biases on every projection, a plain
(ungated) GELU MLP, multi-head attention, tied head. Every module is the shared one from
zoo/layers/; GPT-2's fused qkv projection is split into q/k/v at load time (params.py)."""

from __future__ import annotations

import dataclasses

from zoo.layers.config import DecoderConfig
from zoo.layers.decoder import DecoderLM


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPT2Config(DecoderConfig):
    norm: str = "layer"
    norm_eps: float = 1e-5
    use_bias: bool = True
    activation: str = "gelu_tanh"  # HF's gelu_new
    glu: bool = False
    position: str = "learned"  # a [max_seq_len, M] table: max_seq_len is n_positions
    tie_embeddings: bool = True

    @classmethod
    def gpt2(cls, **overrides) -> GPT2Config:
        """GPT-2 small, 124M."""
        base = dict(
            vocab_size=50_257,
            hidden_dim=768,
            num_layers=12,
            num_heads=12,
            num_kv_heads=12,
            head_dim=64,
            ffn_dim=3072,
            max_seq_len=1024,
        )
        return cls(**{**base, **overrides})

    @classmethod
    def gpt2_medium(cls, **overrides) -> GPT2Config:
        """GPT-2 medium, 355M."""
        base = dict(
            vocab_size=50_257,
            hidden_dim=1024,
            num_layers=24,
            num_heads=16,
            num_kv_heads=16,
            head_dim=64,
            ffn_dim=4096,
            max_seq_len=1024,
        )
        return cls(**{**base, **overrides})


class GPT2(DecoderLM):
    """The shared decoder with `position='learned'`, `norm='layer'`, `use_bias`, `glu=False`."""


PRESETS = {"gpt2": GPT2Config.gpt2, "gpt2-medium": GPT2Config.gpt2_medium}
