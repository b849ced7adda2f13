"""DeepSeek-V3 checkpoints <-> ours: transformers' `DeepseekV3ForCausalLM` names (the hub's
layout, one tensor per expert, which transformers 5 still writes and reads). Layer i of the
checkpoint is `dense_blocks[i]` for i < first_dense_layers, else `blocks[i - k]`. The hub's
FP8 weights (block-scaled, `quant_method: fp8`) are dequantized as they are read
(zoo/hf_dequantize.py).

Multi-token prediction: depth k's module is the checkpoint's layer L + k - 1 (past
num_hidden_layers = L): `enorm`, `hnorm`, `eh_proj`, a MoE layer's attention, experts and
norms, and `shared_head.norm` -> `mtp_blocks[k - 1]`. Its `embed_tokens` and
`shared_head.head` are copies of the model's embedding and LM head, which the MTP modules
share: import ignores them, export writes them (vLLM and SGLang read them). With mtp_depth 0
(the default, as transformers) every layer past L is ignored."""

from __future__ import annotations

from nnx_zoo.errors import UsageError
from zoo.deepseek_v3.modeling import DeepseekV3Config
from zoo.hf_dequantize import FP8
from zoo.hf_mapping import LINEAR_IN, LINEAR_OUT, HfFormat, rope_parameters, rule
from zoo.llama.params import LAYER

MLP = (("gate", LINEAR_IN), ("up", LINEAR_IN), ("down", LINEAR_OUT))


def _layer_rules(cfg: DeepseekV3Config, stack: str) -> list:
    """The attention and the norms of every layer of `stack` (dense_blocks or blocks)."""
    attn = LAYER + "self_attn."
    ours = stack + "/attention/"
    rules = [
        rule(LAYER + "input_layernorm.weight", f"{stack}/attn_norm/weight"),
        rule(LAYER + "post_attention_layernorm.weight", f"{stack}/mlp_norm/weight"),
        rule(attn + "kv_a_proj_with_mqa.weight", ours + "kv_a/weight", transform=LINEAR_IN),
        rule(attn + "kv_a_layernorm.weight", ours + "kv_a_norm/weight"),
        rule(attn + "kv_b_proj.weight", ours + "kv_b/weight", transform=LINEAR_IN),
        rule(attn + "o_proj.weight", ours + "o/weight", transform=LINEAR_OUT),
    ]
    if cfg.q_lora_rank:
        rules += [
            rule(attn + "q_a_proj.weight", ours + "q_a/weight", transform=LINEAR_IN),
            rule(attn + "q_a_layernorm.weight", ours + "q_a_norm/weight"),
            rule(attn + "q_b_proj.weight", ours + "q_b/weight", transform=LINEAR_IN),
        ]
    else:
        rules.append(rule(attn + "q_proj.weight", ours + "q/weight", transform=LINEAR_IN))
    return rules


def _moe_rules(stack: str, shared: bool) -> list:
    """The routed (and shared) experts and the router of every layer of `stack`."""
    moe = LAYER + "mlp."
    out = [
        rule(moe + "gate.weight", f"{stack}/moe/router/weight", transform=LINEAR_IN),
        rule(moe + "gate.e_score_correction_bias", f"{stack}/moe/e_score_correction_bias"),
        *(
            rule(moe + f"experts.{{e}}.{x}_proj.weight", f"{stack}/moe/{x}", transform=t)
            for x, t in MLP
        ),
    ]
    if shared:
        out += [
            rule(
                moe + f"shared_experts.{x}_proj.weight",
                f"{stack}/moe/shared/{x}/weight",
                transform=t,
            )
            for x, t in MLP
        ]
    return out


def _mtp_rules(cfg: DeepseekV3Config) -> list:
    """Each MTP depth's module (`mtp_blocks[k]`, the checkpoint's layer L + k)."""
    return [
        rule(LAYER + "enorm.weight", "mtp_blocks/enorm/weight"),
        rule(LAYER + "hnorm.weight", "mtp_blocks/hnorm/weight"),
        rule(LAYER + "eh_proj.weight", "mtp_blocks/eh_proj/weight", transform=LINEAR_IN),
        rule(LAYER + "shared_head.norm.weight", "mtp_blocks/head_norm/weight"),
        *_layer_rules(cfg, "mtp_blocks/block"),
        *_moe_rules("mtp_blocks/block", bool(cfg.num_shared_experts)),
    ]


def rules(cfg: DeepseekV3Config) -> list:
    out = [
        rule("model.embed_tokens.weight", "embed/table"),
        rule("model.norm.weight", "final_norm/weight"),
        rule("lm_head.weight", "lm_head/weight", transform=LINEAR_IN),
        *_layer_rules(cfg, "blocks"),
    ]
    if cfg.first_dense_layers:
        out += _layer_rules(cfg, "dense_blocks")
        out += [
            rule(LAYER + f"mlp.{x}_proj.weight", f"dense_blocks/mlp/{x}/weight", transform=t)
            for x, t in MLP
        ]
    out += _moe_rules("blocks", bool(cfg.num_shared_experts))
    return out + (_mtp_rules(cfg) if cfg.mtp_depth else [])


def stacks(cfg: DeepseekV3Config) -> dict[str, tuple[int, int]]:
    k, L = cfg.first_dense_layers, cfg.num_layers
    dense = {"dense_blocks": (0, k)} if k else {}
    mtp = {"mtp_blocks": (L, cfg.mtp_depth)} if cfg.mtp_depth else {}
    return {**dense, "blocks": (k, L - k), **mtp}


def _mtp_layers(cfg: DeepseekV3Config) -> range:
    return range(cfg.num_layers, cfg.num_layers + cfg.mtp_depth)


def ignored(cfg: DeepseekV3Config) -> tuple[str, ...]:
    """Every layer past the model's and its MTP depths' (the published checkpoint's MTP
    layer 61 when mtp_depth is 0, as transformers skips it), and the MTP layers' copies of
    the embedding and the LM head."""
    ours = "|".join(str(i) for i in range(cfg.num_layers + cfg.mtp_depth))
    heads = [
        rf"model\.layers\.{i}\.(embed_tokens|shared_head\.head)\.weight" for i in _mtp_layers(cfg)
    ]
    return (rf"model\.layers\.(?!(?:{ours})\.)\d+\..*", *heads)


def copies(cfg: DeepseekV3Config) -> dict[str, tuple[str, ...]]:
    """The MTP layers' copies of the embedding and the LM head, which export writes."""
    layers = _mtp_layers(cfg)
    return {
        "model.embed_tokens.weight": tuple(f"model.layers.{i}.embed_tokens.weight" for i in layers),
        "lm_head.weight": tuple(f"model.layers.{i}.shared_head.head.weight" for i in layers),
    }


def _yarn(rope: dict, max_positions: int) -> tuple | None:
    kind = rope.get("rope_type", "default")
    if kind == "default":
        return None
    if kind != "yarn" or rope.get("attention_factor") is not None:
        raise UsageError(
            f"DeepSeek-V3 rope {kind!r} (attention_factor={rope.get('attention_factor')}) is "
            "not supported; valid: default, or yarn without an explicit attention_factor"
        )
    if rope.get("truncate") is False:
        raise UsageError("DeepSeek-V3 yarn with truncate=false is not supported")
    original = int(rope["original_max_position_embeddings"])
    factor = rope.get("factor") or max_positions / original
    return (
        float(factor),
        original,
        float(rope.get("beta_fast") or 32),
        float(rope.get("beta_slow") or 1),
        float(rope.get("mscale") or 0),
        float(rope.get("mscale_all_dim") or 0),
    )


def config_from_hf(hf: dict) -> dict:
    if hf.get("attention_bias"):
        raise UsageError("config.json attention_bias=true is not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise UsageError(f"config.json hidden_act {hf['hidden_act']!r}; expected 'silu'")
    if hf.get("topk_method", "noaux_tc") != "noaux_tc" or hf.get("scoring_func", "sigmoid") != (
        "sigmoid"
    ):
        raise UsageError(
            "DeepSeek-V3 routing with topk_method noaux_tc and scoring_func sigmoid only"
        )
    heads = hf["num_attention_heads"]
    if (hf.get("num_key_value_heads") or heads) != heads:
        raise UsageError("DeepSeek-V3 num_key_value_heads must equal num_attention_heads")
    rope = rope_parameters(hf)
    max_positions = hf.get("max_position_embeddings", 4096)
    nope, rot = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"]
    return dict(
        vocab_size=hf["vocab_size"],
        hidden_dim=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=nope + rot,
        ffn_dim=hf["intermediate_size"],
        max_seq_len=max_positions,
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_embeddings=hf.get("tie_word_embeddings", False),
        rope_theta=float(rope.get("rope_theta", 10_000.0)),
        rope_yarn=_yarn(rope, max_positions),
        rope_interleave=bool(hf.get("rope_interleave", True)),
        q_lora_rank=hf.get("q_lora_rank") or 0,
        kv_lora_rank=hf["kv_lora_rank"],
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rot,
        v_head_dim=hf["v_head_dim"],
        num_experts=hf.get("n_routed_experts") or hf["num_local_experts"],
        num_experts_per_tok=hf["num_experts_per_tok"],
        moe_ffn_dim=hf["moe_intermediate_size"],
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        moe_groups=hf.get("n_group") or 1,
        moe_groups_per_tok=hf.get("topk_group") or 1,
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        num_shared_experts=hf.get("n_shared_experts") or 0,
        first_dense_layers=hf.get("first_k_dense_replace") or 0,
    )


def _rope_to_hf(cfg: DeepseekV3Config) -> dict:
    if cfg.rope_yarn is None:
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    factor, original, beta_fast, beta_slow, mscale, mscale_all_dim = cfg.rope_yarn
    return {
        "rope_type": "yarn",
        "rope_theta": cfg.rope_theta,
        "factor": factor,
        "original_max_position_embeddings": original,
        "beta_fast": beta_fast,
        "beta_slow": beta_slow,
        "mscale": mscale,
        "mscale_all_dim": mscale_all_dim,
    }


def config_to_hf(cfg: DeepseekV3Config) -> dict:
    if cfg.tie_embeddings:
        raise UsageError("DeepSeek-V3 checkpoints have an untied lm_head; tie_embeddings=False")
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_dim,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "intermediate_size": cfg.ffn_dim,
        "moe_intermediate_size": cfg.moe_ffn_dim,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "rope_parameters": _rope_to_hf(cfg),
        "rope_interleave": cfg.rope_interleave,
        "attention_bias": False,
        "q_lora_rank": cfg.q_lora_rank or None,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "n_routed_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "norm_topk_prob": cfg.norm_topk_prob,
        "n_group": cfg.moe_groups,
        "topk_group": cfg.moe_groups_per_tok,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "n_shared_experts": cfg.num_shared_experts,
        "first_k_dense_replace": cfg.first_dense_layers,
        # The MTP depths the export holds (a run without them writes none).
        "num_nextn_predict_layers": cfg.mtp_depth,
        "dtype": "float32",
    }


HF_FORMAT = HfFormat(
    architectures=("DeepseekV3ForCausalLM",),
    model_types=("deepseek_v3",),
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    rules=rules,
    stacks=stacks,
    ignored=ignored,
    copies=copies,
    quantizations=(FP8,),
)
