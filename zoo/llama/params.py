"""Llama checkpoints <-> ours, and the Llama-lineage names and config.json fields that Qwen3,
Mistral and Gemma 3 share (their params.py add only what differs)."""

from __future__ import annotations

from nnx_zoo.errors import UsageError
from zoo.hf_mapping import (
    LINEAR_IN,
    LINEAR_OUT,
    HfFormat,
    rope_parameters,
    rope_scaling,
    rope_to_hf,
    rope_to_legacy_hf,
    rule,
)
from zoo.layers.config import DecoderConfig

LAYER = "model.layers.{i}."


# Llama's second norm of a block, HF's `post_attention_layernorm`, is the one before the MLP.
BLOCK_NORMS = {"post_attention_layernorm": "blocks/mlp_norm/weight"}


def decoder_rules(cfg: DecoderConfig, block_norms: dict[str, str] = BLOCK_NORMS):
    """`model.layers.{i}.self_attn.q_proj.weight` etc.; q/k norms when the config has them,
    `block_norms` (HF name in a layer -> our param) for the norms after the first, `lm_head`
    when it is not tied to the embedding."""
    rules = [
        rule("model.embed_tokens.weight", "embed/table"),
        rule(LAYER + "input_layernorm.weight", "blocks/attn_norm/weight"),
        *(
            rule(LAYER + f"self_attn.{x}_proj.weight", f"blocks/attention/{x}/weight", transform=t)
            for x, t in (("q", LINEAR_IN), ("k", LINEAR_IN), ("v", LINEAR_IN), ("o", LINEAR_OUT))
        ),
        *(
            rule(LAYER + f"mlp.{x}_proj.weight", f"blocks/mlp/{x}/weight", transform=t)
            for x, t in (("gate", LINEAR_IN), ("up", LINEAR_IN), ("down", LINEAR_OUT))
        ),
        rule("model.norm.weight", "final_norm/weight"),
    ]
    if cfg.qk_norm:
        rules += [
            rule(LAYER + "self_attn.q_norm.weight", "blocks/attention/q_norm/weight"),
            rule(LAYER + "self_attn.k_norm.weight", "blocks/attention/k_norm/weight"),
        ]
    rules += [rule(LAYER + f"{hf}.weight", ours) for hf, ours in block_norms.items()]
    if not cfg.tie_embeddings:
        rules.append(rule("lm_head.weight", "lm_head/weight", transform=LINEAR_IN))
    return rules


def decoder_config_from_hf(
    hf: dict, *, tie_default: bool, act: str = "silu", rope_layer_type: str | None = None
) -> dict:
    """The fields every Llama-lineage config.json spells the same way."""
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise UsageError(f"config.json {flag}=true is not supported")
    found = hf.get("hidden_activation") or hf.get("hidden_act") or act
    if found != act:
        raise UsageError(f"config.json activation {found!r} is not supported; expected {act!r}")
    heads = hf["num_attention_heads"]
    rope = rope_parameters(hf, rope_layer_type)
    return dict(
        vocab_size=hf["vocab_size"],
        hidden_dim=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        ffn_dim=hf["intermediate_size"],
        max_seq_len=hf.get("max_position_embeddings", 8192),
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_embeddings=hf.get("tie_word_embeddings", tie_default),
        rope_theta=float(rope["rope_theta"]),
        rope_scaling=rope_scaling(rope),
    )


def decoder_config_to_hf(cfg: DecoderConfig, architecture: str, model_type: str) -> dict:
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_dim,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.ffn_dim,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "rope_parameters": rope_to_hf(cfg.rope_theta, cfg.rope_scaling),
        **rope_to_legacy_hf(cfg.rope_theta, cfg.rope_scaling),
        "attention_bias": False,
        "dtype": "float32",
    }


HF_FORMAT = HfFormat(
    architectures=("LlamaForCausalLM",),
    model_types=("llama",),
    config_from_hf=lambda hf: decoder_config_from_hf(hf, tie_default=False),
    config_to_hf=lambda cfg: {
        **decoder_config_to_hf(cfg, "LlamaForCausalLM", "llama"),
        "mlp_bias": False,
    },
    rules=decoder_rules,
    # Older exports keep RoPE's inverse frequencies as a buffer; we compute them.
    ignored=(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",),
)
