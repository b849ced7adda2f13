"""Qwen3-MoE: Qwen3 (q/k norms, head dim apart from M / N) whose every block's MLP is a
mixture of experts without a shared expert. The shared zoo/layers/ modules, configured."""

from __future__ import annotations

import dataclasses

from zoo.layers.config import DecoderConfig
from zoo.layers.decoder import DecoderLM
from zoo.registry import experts, preset_table


@dataclasses.dataclass(frozen=True, kw_only=True)
class Qwen3MoeConfig(DecoderConfig):
    rope_theta: float = 1_000_000.0
    norm_eps: float = 1e-6
    qk_norm: bool = True
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.001  # transformers' Qwen3MoeConfig default


class Qwen3Moe(DecoderLM):
    """The shared decoder; `num_experts` > 0 gives every block the MoE feed-forward."""


_TINY = {**experts(8, 2, 64), "router_aux_loss_coef": 0.01}
PRESETS = preset_table(
    Qwen3MoeConfig,
    {
        # V, M, L, N, K, D, F, T (zoo.registry.PRESET_DIMS), then the experts: E, top k and
        # each expert's F (F itself is unused: no dense layers). qwen3-moe-tiny, for tests and
        # CPU runs: 8 experts, splittable by expert axes 2, 4, 8.
        "qwen3-moe-tiny": (512, 64, 2, 8, 4, 16, 128, 256, _TINY),
        "qwen3-30b-a3b": (151_936, 2048, 48, 32, 4, 128, 6144, 40_960, experts(128, 8, 768)),
    },
)
