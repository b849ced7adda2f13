"""GPT-2 checkpoints (GPT2LMHeadModel) <-> ours.

Conv1D weights are already [in, out]. `c_attn` fuses q | k | v along its output dim (weight
[M, 3*M], bias [3*M]): split into our three [M, N, D] projections on load, fused on export.
"""

from __future__ import annotations

from nnx_zoo.errors import UsageError
from zoo.gpt2.modeling import GPT2Config
from zoo.hf_mapping import CONV1D_OUT, LINEAR_IN, HfFormat, fused_last_dim, rule

H = "transformer.h.{i}."
ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


def rules(cfg: GPT2Config):
    qkv = ("q", "k", "v")
    out = [
        rule("transformer.wte.weight", "embed/table"),
        rule("transformer.wpe.weight", "position_embed/table"),
        rule(H + "attn.c_attn.weight", *(f"blocks/attention/{x}/weight" for x in qkv),
             transform=fused_last_dim(1)),
        rule(H + "attn.c_attn.bias", *(f"blocks/attention/{x}/bias" for x in qkv),
             transform=fused_last_dim(0)),
        rule(H + "attn.c_proj.weight", "blocks/attention/o/weight", transform=CONV1D_OUT),
        rule(H + "attn.c_proj.bias", "blocks/attention/o/bias"),
    ]  # fmt: skip
    for hf, ours in (
        ("ln_1", "blocks/attn_norm"),
        ("ln_2", "blocks/mlp_norm"),
        ("mlp.c_fc", "blocks/mlp/up"),
        ("mlp.c_proj", "blocks/mlp/down"),
    ):
        out += [rule(H + f"{hf}.{p}", f"{ours}/{p}") for p in ("weight", "bias")]
    out += [rule(f"transformer.ln_f.{p}", f"final_norm/{p}") for p in ("weight", "bias")]
    if not cfg.tie_embeddings:
        out.append(rule("lm_head.weight", "lm_head/weight", transform=LINEAR_IN))
    return out


def config_from_hf(hf: dict) -> dict:
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if hf.get(flag):
            raise UsageError(f"config.json {flag}=true is not supported")
    act = hf.get("activation_function", "gelu_new")
    if act not in ACTIVATIONS:
        raise UsageError(f"config.json activation_function {act!r}; supported: {list(ACTIVATIONS)}")
    M, N = hf["n_embd"], hf["n_head"]
    return dict(
        vocab_size=hf["vocab_size"],
        hidden_dim=M,
        num_layers=hf["n_layer"],
        num_heads=N,
        num_kv_heads=N,
        head_dim=M // N,
        ffn_dim=hf.get("n_inner") or 4 * M,
        max_seq_len=hf["n_positions"],
        norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        activation=ACTIVATIONS[act],
        attn_scale=None if hf.get("scale_attn_weights", True) else 1.0,
        tie_embeddings=hf.get("tie_word_embeddings", True),
    )


def config_to_hf(cfg: GPT2Config) -> dict:
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_embd": cfg.hidden_dim,
        "n_layer": cfg.num_layers,
        "n_head": cfg.num_heads,
        "n_inner": cfg.ffn_dim,
        "n_positions": cfg.max_seq_len,
        "layer_norm_epsilon": cfg.norm_eps,
        "activation_function": "gelu" if cfg.activation == "gelu" else "gelu_new",
        "scale_attn_weights": cfg.attn_scale is None,
        "tie_word_embeddings": cfg.tie_embeddings,
        # <|endoftext|>, GPT-2's last token (50256); transformers' default is out of range
        # for any other vocabulary.
        "bos_token_id": cfg.vocab_size - 1,
        "eos_token_id": cfg.vocab_size - 1,
        "dtype": "float32",
    }


HF_FORMAT = HfFormat(
    architectures=("GPT2LMHeadModel",),
    model_types=("gpt2",),
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    rules=rules,
    # Causal-mask buffers some exports hold, and a tied head stored anyway.
    ignored=(r"(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)", r"lm_head\.weight"),
    optional_prefix="transformer.",
)
