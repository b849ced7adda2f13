"""Qwen3-MoE checkpoints <-> ours: Qwen3's names and config, the MLP replaced by a router
(`mlp.gate`) and one tensor per expert (`mlp.experts.{e}.{gate,up,down}_proj`), the hub's
layout, which transformers 5 still writes and reads."""

from __future__ import annotations

from nnx_zoo.errors import UsageError
from zoo.hf_mapping import LINEAR_IN, LINEAR_OUT, HfFormat, rule
from zoo.layers.config import DecoderConfig
from zoo.llama.params import LAYER, decoder_rules
from zoo.qwen3 import params as qwen3_params
from zoo.qwen3_moe.modeling import Qwen3MoeConfig


def moe_rules(cfg: DecoderConfig, block: str, router: str, experts: dict[str, str]):
    """The Llama-lineage rules with the dense MLP's replaced by a router and experts.

    block: the MoE module's name in a layer ('mlp.', 'block_sparse_moe.'); router: its
    router's; experts: our name (gate, up, down) -> the checkpoint's per-expert name."""
    rules = [r for r in decoder_rules(cfg) if not r.ours[0].startswith("blocks/mlp/")]
    rules.append(
        rule(LAYER + block + router + ".weight", "blocks/moe/router/weight", transform=LINEAR_IN)
    )
    for ours, theirs in experts.items():
        rules.append(
            rule(
                LAYER + block + "experts.{e}." + theirs + ".weight",
                f"blocks/moe/{ours}",
                transform=LINEAR_OUT if ours == "down" else LINEAR_IN,
            )
        )
    return rules


def check_all_layers_sparse(hf: dict) -> None:
    if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
        raise UsageError(
            "dense layers between MoE layers (mlp_only_layers, decoder_sparse_step != 1) are "
            "not supported; every layer must be MoE"
        )
    if hf.get("router_jitter_noise"):
        raise UsageError("router_jitter_noise is not supported; expected 0")


def config_from_hf(hf: dict) -> dict:
    check_all_layers_sparse(hf)
    return {
        **qwen3_params.config_from_hf(hf),
        "num_experts": hf.get("num_experts") or hf["num_local_experts"],
        "num_experts_per_tok": hf["num_experts_per_tok"],
        "moe_ffn_dim": hf["moe_intermediate_size"],
        "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
        "router_aux_loss_coef": float(hf.get("router_aux_loss_coef", 0.001)),
    }


def config_to_hf(cfg: Qwen3MoeConfig) -> dict:
    return {
        **qwen3_params.config_to_hf(cfg),
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "moe_intermediate_size": cfg.moe_ffn_dim,
        "norm_topk_prob": cfg.norm_topk_prob,
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


HF_FORMAT = HfFormat(
    architectures=("Qwen3MoeForCausalLM",),
    model_types=("qwen3_moe",),
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    rules=lambda cfg: moe_rules(
        cfg, "mlp.", "gate", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
    ),
    ignored=(r"lm_head\.weight",),
)
