"""GPT-OSS (OpenAI, 2025): a mixture of experts in every block, attention sinks, layers
alternating a sliding window and full attention, biases on q/k/v/o, the router and the
experts, a clamped SwiGLU, YaRN RoPE. The shared zoo/layers/ modules, configured.

Where transformers' GptOssForCausalLM words it differently, the two agree:
- the router takes the top k of its logits and softmaxes those k; the zoo softmaxes all E
  and renormalises the top k (`norm_topk_prob`), the same weights, since the top k of the
  logits and of their softmax are the same experts;
- the experts' `gate_up_proj` interleaves gate and up columns (gate = [..., ::2]); the zoo
  keeps them as two weights, split on load and interleaved again on save (params.py);
- YaRN multiplies cos and sin by its attention factor, so q and k; the zoo multiplies the
  softmax scale by its square (`DecoderConfig.softmax_scale`), the same logits.
"""

from __future__ import annotations

import dataclasses

from zoo.layers.config import DecoderConfig
from zoo.layers.decoder import DecoderLM
from zoo.registry import experts, preset_table

# The published models' YaRN: factor 32 over an original 4096-token context, transformers'
# GptOssConfig default (factor, beta_fast, beta_slow, original context, truncate).
YARN = (32.0, 32.0, 1.0, 4096, False)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GptOssConfig(DecoderConfig):
    rope_theta: float = 150_000.0
    rope_scaling: tuple | None = YARN
    norm_eps: float = 1e-5
    sliding_window: int | None = 128
    # Layer 0 slides, layer 1 attends globally, and so on (transformers' default layer_types).
    global_every: int = 2
    attention_sinks: bool = True
    attention_bias: bool = True
    moe_bias: bool = True
    moe_activation: str = "clamped_swiglu"
    norm_topk_prob: bool = True  # softmax over the top k logits
    router_aux_loss_coef: float = 0.001  # transformers' GptOssConfig default


class GptOss(DecoderLM):
    """The shared decoder: MoE feed-forward in every block, sinks in every attention."""


PRESETS = preset_table(
    GptOssConfig,
    {
        # V, M, L, N, K, D, F, T (zoo.registry.PRESET_DIMS), then the experts: E, top k and
        # each expert's F (F = the expert width, as config.json's intermediate_size).
        # gpt-oss-tiny, for tests and CPU runs: 8 experts (split by expert axes 2, 4, 8), a
        # window of 8 so that short test rows cross it, YaRN over an original 64 tokens.
        "gpt-oss-tiny": (
            512,
            64,
            2,
            8,
            4,
            16,
            64,
            256,
            {**experts(8, 2, 64), "sliding_window": 8, "rope_scaling": (4.0, 32.0, 1.0, 64, False)},
        ),
        # openai/gpt-oss-20b and -120b, config.json as published.
        "gpt-oss-20b": (201_088, 2880, 24, 64, 8, 64, 2880, 131_072, experts(32, 4, 2880)),
        "gpt-oss-120b": (201_088, 2880, 36, 64, 8, 64, 2880, 131_072, experts(128, 4, 2880)),
    },
)
