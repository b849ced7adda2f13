"""Mixtral: Mistral-style blocks (no q/k norms) whose MLP is a mixture of 8 experts, top 2,
with the top-k router weights always renormalised. The shared zoo/layers/ modules."""

from __future__ import annotations

import dataclasses

from zoo.layers.config import DecoderConfig
from zoo.layers.decoder import DecoderLM


@dataclasses.dataclass(frozen=True, kw_only=True)
class MixtralConfig(DecoderConfig):
    rope_theta: float = 1_000_000.0
    norm_eps: float = 1e-5
    norm_topk_prob: bool = True  # Mixtral's router always renormalises its top k
    router_aux_loss_coef: float = 0.02  # transformers' MixtralConfig default

    @classmethod
    def tiny(cls, **overrides) -> MixtralConfig:
        """For tests and CPU runs: 8 experts, top 2."""
        base = dict(
            vocab_size=512,
            hidden_dim=64,
            num_layers=2,
            num_heads=8,
            num_kv_heads=4,
            head_dim=8,
            ffn_dim=64,
            num_experts=8,
            num_experts_per_tok=2,
            moe_ffn_dim=64,
            max_seq_len=256,
        )
        return cls(**{**base, **overrides})

    @classmethod
    def mixtral_8x7b(cls, **overrides) -> MixtralConfig:
        base = dict(
            vocab_size=32_000,
            hidden_dim=4096,
            num_layers=32,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            ffn_dim=14_336,
            num_experts=8,
            num_experts_per_tok=2,
            moe_ffn_dim=14_336,
            max_seq_len=32_768,
        )
        return cls(**{**base, **overrides})


class Mixtral(DecoderLM):
    """The shared decoder with the MoE feed-forward in every block."""


PRESETS = {"mixtral-tiny": MixtralConfig.tiny, "mixtral-8x7b": MixtralConfig.mixtral_8x7b}
