"""Gemma 3 text checkpoints (Gemma3ForCausalLM) <-> ours: Llama's names with four norms per
block, and a config.json with per-layer-type RoPE and attention kinds."""

from __future__ import annotations

from nnx_zoo.errors import UsageError
from zoo.gemma3.modeling import Gemma3Config
from zoo.hf_mapping import HfFormat, rope_parameters, rope_scaling, rope_to_hf
from zoo.layers.config import FULL, SLIDING
from zoo.llama.params import decoder_config_from_hf, decoder_config_to_hf, decoder_rules

ACT = "gelu_pytorch_tanh"
# Four norms per block; here HF's `post_attention_layernorm` norms the attention's output.
BLOCK_NORMS = {
    "post_attention_layernorm": "blocks/post_attn_norm/weight",
    "pre_feedforward_layernorm": "blocks/mlp_norm/weight",
    "post_feedforward_layernorm": "blocks/post_mlp_norm/weight",
}


def config_from_hf(hf: dict) -> dict:
    fields = decoder_config_from_hf(hf, tie_default=True, act=ACT, rope_layer_type=FULL)
    if "rope_parameters" in hf:  # transformers 5: one RoPE dict per layer type
        local = rope_parameters(hf, SLIDING)
    else:  # 4.x: the local base was its own field, never scaled
        local = {"rope_type": "default", "rope_theta": hf.get("rope_local_base_freq", 10_000.0)}
    if rope_scaling(local) is not None:
        raise UsageError("config.json: scaled RoPE on sliding layers is not supported")
    L = hf["num_hidden_layers"]
    # 4.x had only the pattern: layer i is sliding unless (i + 1) % pattern == 0.
    pattern = hf.get("sliding_window_pattern", 6)
    types = hf.get("layer_types") or [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(L)]
    scalar = hf.get("query_pre_attn_scalar", fields["head_dim"])
    fields.update(
        rope_local_theta=float(local["rope_theta"]),
        sliding_window=hf.get("sliding_window"),
        layer_types=tuple(types),
        attn_scale=None if scalar == fields["head_dim"] else scalar**-0.5,
        # attn_logit_softcapping is ignored, as transformers' Gemma3Attention ignores it.
        final_logit_softcap=hf.get("final_logit_softcapping"),
    )
    return fields


def config_to_hf(cfg: Gemma3Config) -> dict:
    hf = decoder_config_to_hf(cfg, "Gemma3ForCausalLM", "gemma3_text")
    del hf["hidden_act"]
    scalar = cfg.head_dim if cfg.attn_scale is None else cfg.attn_scale**-2
    windows = cfg.layer_windows()
    # 4.x knew only a period: written when the layers follow one (global at (i + 1) % p == 0).
    period = next((i + 1 for i, w in enumerate(windows) if not w), len(windows) + 1)
    if windows == [cfg.sliding_window if (i + 1) % period else 0 for i in range(len(windows))]:
        hf["sliding_window_pattern"] = period
    hf.update(
        hidden_activation=ACT,
        rope_parameters={
            FULL: rope_to_hf(cfg.rope_theta, cfg.rope_scaling),
            SLIDING: rope_to_hf(cfg.rope_local_theta, None),
        },
        layer_types=[SLIDING if w else FULL for w in windows],
        rope_local_base_freq=cfg.rope_local_theta,  # 4.x's name, read when no rope_parameters
        sliding_window=cfg.sliding_window,
        query_pre_attn_scalar=round(scalar) if abs(scalar - round(scalar)) < 1e-6 else scalar,
        final_logit_softcapping=cfg.final_logit_softcap,
        attn_logit_softcapping=None,
    )
    return hf


HF_FORMAT = HfFormat(
    architectures=("Gemma3ForCausalLM",),
    model_types=("gemma3_text",),
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    rules=lambda cfg: decoder_rules(cfg, BLOCK_NORMS),
    ignored=(r"lm_head\.weight",),
)
