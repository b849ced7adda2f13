"""Qwen3-MoE: Qwen3 (q/k norms, head dim apart from M / N) whose every block's MLP is a
mixture of experts without a shared expert. The shared zoo/layers/ modules, configured."""

from __future__ import annotations

import dataclasses

from zoo.layers.config import DecoderConfig
from zoo.layers.decoder import DecoderLM


@dataclasses.dataclass(frozen=True, kw_only=True)
class Qwen3MoeConfig(DecoderConfig):
    rope_theta: float = 1_000_000.0
    norm_eps: float = 1e-6
    qk_norm: bool = True
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.001  # transformers' Qwen3MoeConfig default

    @classmethod
    def tiny(cls, **overrides) -> Qwen3MoeConfig:
        """For tests and CPU runs: 8 experts (splittable by expert axes 2, 4, 8), top 2."""
        base = dict(
            vocab_size=512,
            hidden_dim=64,
            num_layers=2,
            num_heads=8,
            num_kv_heads=4,
            head_dim=16,
            ffn_dim=128,  # unused: no dense layers; kept for the config's dense fields
            num_experts=8,
            num_experts_per_tok=2,
            moe_ffn_dim=64,
            max_seq_len=256,
            router_aux_loss_coef=0.01,
        )
        return cls(**{**base, **overrides})

    @classmethod
    def qwen3_30b_a3b(cls, **overrides) -> Qwen3MoeConfig:
        base = dict(
            vocab_size=151_936,
            hidden_dim=2048,
            num_layers=48,
            num_heads=32,
            num_kv_heads=4,
            head_dim=128,
            ffn_dim=6144,
            num_experts=128,
            num_experts_per_tok=8,
            moe_ffn_dim=768,
            max_seq_len=40_960,
        )
        return cls(**{**base, **overrides})


class Qwen3Moe(DecoderLM):
    """The shared decoder; `num_experts` > 0 gives every block the MoE feed-forward."""


PRESETS = {
    "qwen3-moe-tiny": Qwen3MoeConfig.tiny,
    "qwen3-30b-a3b": Qwen3MoeConfig.qwen3_30b_a3b,
}
