"""Mixtral: Mistral-style blocks (no q/k norms) whose MLP is a mixture of 8 experts, top 2,
with the top-k router weights always renormalised. The shared zoo/layers/ modules."""

from __future__ import annotations

import dataclasses

from zoo.layers.config import DecoderConfig
from zoo.layers.decoder import DecoderLM
from zoo.registry import experts, preset_table


@dataclasses.dataclass(frozen=True, kw_only=True)
class MixtralConfig(DecoderConfig):
    rope_theta: float = 1_000_000.0
    norm_eps: float = 1e-5
    norm_topk_prob: bool = True  # Mixtral's router always renormalises its top k
    router_aux_loss_coef: float = 0.02  # transformers' MixtralConfig default


class Mixtral(DecoderLM):
    """The shared decoder with the MoE feed-forward in every block."""


PRESETS = preset_table(
    MixtralConfig,
    {
        # V, M, L, N, K, D, F, T (zoo.registry.PRESET_DIMS), then the experts: E, top k and
        # each expert's F. mixtral-tiny, for tests and CPU runs.
        "mixtral-tiny": (512, 64, 2, 8, 4, 8, 64, 256, experts(8, 2, 64)),
        "mixtral-8x7b": (32_000, 4096, 32, 32, 8, 128, 14_336, 32_768, experts(8, 2, 14_336)),
    },
)
