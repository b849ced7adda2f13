"""Mixtral checkpoints <-> ours: Mistral's names and config, the MLP replaced by
`block_sparse_moe.gate` (router) and per-expert `w1` (gate), `w3` (up), `w2` (down)."""

from __future__ import annotations

from nnx_zoo.errors import UsageError
from zoo.hf_mapping import HfFormat
from zoo.llama.params import decoder_config_from_hf, decoder_config_to_hf
from zoo.mixtral.modeling import MixtralConfig
from zoo.qwen3_moe.params import check_all_layers_sparse, moe_rules


def config_from_hf(hf: dict) -> dict:
    check_all_layers_sparse(hf)
    fields = decoder_config_from_hf(hf, tie_default=False)
    # Mixtral's intermediate_size is the width of one expert; there is no dense MLP.
    return {
        **fields,
        "sliding_window": hf.get("sliding_window"),
        "num_experts": hf["num_local_experts"],
        "num_experts_per_tok": hf["num_experts_per_tok"],
        "moe_ffn_dim": hf["intermediate_size"],
        "router_aux_loss_coef": float(hf.get("router_aux_loss_coef", 0.001)),
    }


def config_to_hf(cfg: MixtralConfig) -> dict:
    if cfg.ffn_dim != cfg.moe_ffn_dim:
        raise UsageError(
            f"MixtralConfig.ffn_dim={cfg.ffn_dim} cannot be written as a MixtralForCausalLM "
            f"config.json: its intermediate_size is the expert width, moe_ffn_dim={cfg.moe_ffn_dim}"
        )
    return {
        **decoder_config_to_hf(cfg, "MixtralForCausalLM", "mixtral"),
        "sliding_window": cfg.sliding_window,
        "num_local_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
        "router_jitter_noise": 0.0,
    }


HF_FORMAT = HfFormat(
    architectures=("MixtralForCausalLM",),
    model_types=("mixtral",),
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    rules=lambda cfg: moe_rules(
        cfg, "block_sparse_moe.", "gate", {"gate": "w1", "up": "w3", "down": "w2"}
    ),
)
