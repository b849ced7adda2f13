"""GPT-OSS checkpoints <-> ours: the Llama lineage's names, plus the attention biases and
sinks, a router with a bias (`mlp.router`) and the experts stacked on E in one tensor each
(`mlp.experts.gate_up_proj` [E, M, 2F], gate and up interleaved column by column, and
`down_proj` [E, F, M], each with its bias), as transformers writes them with
save_pretrained (and as openai/gpt-oss-* store them before MXFP4).

MXFP4: the published checkpoints store the experts' weights as MXFP4 blocks and scales
(`gate_up_proj_blocks`, `..._scales`; transformers' integrations/mxfp4.py). They are
dequantized as they are read (zoo/hf_dequantize.py) into the BF16 layout above, so the rules
below read both."""

from __future__ import annotations

import numpy as np

from nnx_zoo.errors import UsageError
from zoo.gpt_oss.modeling import GptOssConfig
from zoo.hf_dequantize import MXFP4
from zoo.hf_mapping import IDENTITY, LINEAR_IN, HfFormat, Transform, rule
from zoo.layers.config import FULL, SLIDING
from zoo.llama.params import LAYER, decoder_config_from_hf, decoder_config_to_hf, decoder_rules

# A bias over our [N, D] / [K, D] heads is one flat vector in the checkpoint.
FLAT = Transform(load=lambda w, shapes: (w.reshape(shapes[0]),), save=lambda w: w.reshape(-1))


def _interleave(gate, up):
    """[..., F] twice -> [..., 2F]: gate in the even columns, up in the odd."""
    return np.stack([gate, up], axis=-1).reshape(*gate.shape[:-1], 2 * gate.shape[-1])


# transformers' GptOssExperts: gate = gate_up[..., ::2], up = gate_up[..., 1::2].
INTERLEAVED = Transform(
    load=lambda w, shapes: (w[..., ::2].reshape(shapes[0]), w[..., 1::2].reshape(shapes[1])),
    save=_interleave,
)


def rules(cfg: GptOssConfig):
    ours = [r for r in decoder_rules(cfg) if not r.ours[0].startswith("blocks/mlp/")]
    attn, moe = LAYER + "self_attn.", LAYER + "mlp."
    return [
        *ours,
        *(
            rule(attn + f"{x}_proj.bias", f"blocks/attention/{x}/bias", transform=FLAT)
            for x in "qkvo"
        ),
        rule(attn + "sinks", "blocks/attention/sinks"),
        rule(moe + "router.weight", "blocks/moe/router/weight", transform=LINEAR_IN),
        rule(moe + "router.bias", "blocks/moe/router/bias"),
        rule(
            moe + "experts.gate_up_proj", "blocks/moe/gate", "blocks/moe/up", transform=INTERLEAVED
        ),
        rule(
            moe + "experts.gate_up_proj_bias",
            "blocks/moe/gate_bias",
            "blocks/moe/up_bias",
            transform=INTERLEAVED,
        ),
        rule(moe + "experts.down_proj", "blocks/moe/down", transform=IDENTITY),
        rule(moe + "experts.down_proj_bias", "blocks/moe/down_bias", transform=IDENTITY),
    ]


def _check_supported(hf: dict) -> None:
    if not hf.get("attention_bias", True):
        raise UsageError("GPT-OSS config.json attention_bias=false is not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise UsageError(f"config.json hidden_act {hf['hidden_act']!r}; GPT-OSS's is 'silu'")


def config_from_hf(hf: dict) -> dict:
    _check_supported(hf)
    fields = decoder_config_from_hf({**hf, "attention_bias": False}, tie_default=False)
    layers = hf["num_hidden_layers"]
    layer_types = hf.get("layer_types") or [SLIDING if (i + 1) % 2 else FULL for i in range(layers)]
    return {
        **fields,
        "sliding_window": hf.get("sliding_window"),
        "layer_types": tuple(layer_types),
        "num_experts": hf["num_local_experts"],
        "num_experts_per_tok": hf["num_experts_per_tok"],
        "moe_ffn_dim": hf["intermediate_size"],
        "router_aux_loss_coef": float(hf.get("router_aux_loss_coef", 0.001)),
        "swiglu_alpha": float(hf.get("swiglu_alpha", 1.702)),
        "swiglu_limit": float(hf.get("swiglu_limit", 7.0)),
    }


def config_to_hf(cfg: GptOssConfig) -> dict:
    if cfg.ffn_dim != cfg.moe_ffn_dim:
        raise UsageError(
            f"GptOssConfig.ffn_dim={cfg.ffn_dim} cannot be written as a GptOssForCausalLM "
            f"config.json: its intermediate_size is the expert width, moe_ffn_dim={cfg.moe_ffn_dim}"
        )
    hf = decoder_config_to_hf(cfg, "GptOssForCausalLM", "gpt_oss")
    # transformers 5 reads rope_parameters; the legacy top-level copy is not GPT-OSS's.
    hf.pop("rope_scaling", None)
    windows = cfg.layer_windows()
    return {
        **hf,
        "attention_bias": True,
        "sliding_window": cfg.sliding_window,
        "layer_types": [SLIDING if w else FULL for w in windows],
        "num_local_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
        "swiglu_alpha": cfg.swiglu_alpha,
        "swiglu_limit": cfg.swiglu_limit,
        "output_router_logits": False,
    }


HF_FORMAT = HfFormat(
    architectures=("GptOssForCausalLM",),
    model_types=("gpt_oss",),
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    rules=rules,
    quantizations=(MXFP4,),
)
