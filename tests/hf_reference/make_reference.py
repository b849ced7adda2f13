"""Build the Hugging Face reference checkpoints and logits the zoo's parity tests compare against.

This script is the only place that needs torch and transformers; the test suite reads what it
writes (config.json, *.safetensors, inputs_and_logits.npz) with numpy and safetensors alone.

  python tests/hf_reference/make_reference.py                 # regenerate every family
  python tests/hf_reference/make_reference.py --family llama  # one family
  python tests/hf_reference/make_reference.py --layers       # add per-layer outputs to the npz
  python tests/hf_reference/make_reference.py --check-export DIR --family F
      # load DIR (a checkpoint our code exported) with transformers, run the saved input_ids,
      # exit 1 unless its logits equal the reference logits within CHECK_TOL.

Every model is tiny, float32, eager attention, eval mode, seeded. Weights are re-drawn so that
nothing keeps its identity-like init: norm scales and biases get noise, so a wrong norm
convention ((1 + w) vs w) or a dropped bias changes the logits.
"""

import argparse
import copy
import json
import os
import sys

import numpy as np
import torch
import transformers
from safetensors.numpy import load_file
from transformers.pytorch_utils import Conv1D

HERE = os.path.dirname(os.path.abspath(__file__))
FAMILIES = ("llama", "qwen3", "mistral", "gemma3", "gpt2", "qwen3_moe", "mixtral")
MOE_FAMILIES = ("qwen3_moe", "mixtral")  # their npz also holds transformers' aux_loss
BATCH, SEQ_LEN = 2, 24  # T = 3 sliding windows, so the window matters
WINDOW = 8  # sliding window of mistral and gemma3's local layers
SEED = 0
# Two float32 runs of the same model on the same CPU agree far below this; an exported checkpoint
# that is really the same model gives ~1e-6 or exact, any real difference is far above.
CHECK_TOL = 1e-4
# llama is written in several shards plus model.safetensors.index.json (the sharded-load path).
SHARDED = {"llama": "100KB"}
transformers.utils.logging.disable_progress_bar()


def build_config(family):
    """The tiny config of one family: (model class, config)."""
    # Sizes keep all five checkpoints under 2 MB and every sharded dim (V, F, N, K) divisible by 4,
    # so (4, 2) and (2, 4) meshes can shard them.
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=64, rms_norm_eps=1e-5)
    # The decoders' shape: 2 layers, 8 query heads sharing 4 kv heads.
    decoder = dict(
        **common,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
    )
    if family == "llama":
        # head_dim = 64 / 8 = 8: 4 rotary frequencies with wavelengths 6.3, 167, 4.4e3, 1.2e5.
        # With original_max_position_embeddings=256, low/high factors 1/4 (wavelength bounds
        # 256 and 64) the first is kept, the second smoothed, the last two divided by `factor`,
        # so every branch of the Llama 3 formula is exercised.
        rope = dict(
            rope_type="llama3",
            rope_theta=500000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=256,
        )
        cfg = transformers.LlamaConfig(
            **decoder,
            rope_parameters=rope,
            tie_word_embeddings=False,
        )
        return transformers.LlamaForCausalLM, cfg
    if family == "qwen3":
        cfg = transformers.Qwen3Config(
            **decoder,
            head_dim=16,  # != 64 / 8: q_proj is [128, 64]
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
            tie_word_embeddings=True,
            use_sliding_window=False,
        )
        return transformers.Qwen3ForCausalLM, cfg
    if family == "mistral":
        cfg = transformers.MistralConfig(
            **decoder,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
            sliding_window=WINDOW,
            tie_word_embeddings=False,
        )
        return transformers.MistralForCausalLM, cfg
    if family == "gemma3":
        cfg = transformers.Gemma3TextConfig(
            **{**decoder, "num_hidden_layers": 3},
            head_dim=16,
            # layer_types is what transformers reads; sliding_window_pattern is only a
            # backward-compat kwarg (layer i sliding unless (i + 1) % pattern == 0), passed so the
            # `_sliding_window_pattern` written into config.json agrees instead of saying 6.
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            sliding_window_pattern=2,
            sliding_window=WINDOW,
            query_pre_attn_scalar=24,  # scale 24**-0.5, not head_dim**-0.5
            rope_parameters={
                "full_attention": dict(rope_type="default", rope_theta=1000000.0),
                "sliding_attention": dict(rope_type="default", rope_theta=10000.0),
            },
            # raw logits here reach ~15: the cap bends them (ablation below) without flattening
            # them into tanh's saturated tail, where a wrong logit would go unnoticed.
            final_logit_softcapping=10.0,
            # transformers' Gemma3Attention never passes this to the attention function (real
            # Gemma 3 configs have null); kept None so nobody implements a cap HF does not apply.
            attn_logit_softcapping=None,
            hidden_activation="gelu_pytorch_tanh",
            tie_word_embeddings=True,
        )
        return transformers.Gemma3ForCausalLM, cfg
    if family == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=128,
            n_positions=32,
            n_embd=64,
            n_inner=128,  # explicit, != the 4 * n_embd default a loader might assume
            n_layer=2,
            n_head=4,
            activation_function="gelu_new",
            bos_token_id=127,  # the default 50256 is outside this vocabulary
            eos_token_id=127,
            layer_norm_epsilon=1e-5,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        return transformers.GPT2LMHeadModel, cfg
    if family == "qwen3_moe":
        # 4 experts (expert axes 2 and 4 split them), top 2, top-k weights NOT renormalised
        # (Mixtral's are): the two families cover both router conventions.
        cfg = transformers.Qwen3MoeConfig(
            moe_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            **decoder,
            head_dim=16,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
            tie_word_embeddings=False,
            use_sliding_window=False,
        )
        return transformers.Qwen3MoeForCausalLM, cfg
    if family == "mixtral":
        cfg = transformers.MixtralConfig(
            **{**decoder, "intermediate_size": 32},  # Mixtral's intermediate_size: one expert
            num_local_experts=4,
            num_experts_per_tok=2,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
            sliding_window=None,
            router_jitter_noise=0.0,
            tie_word_embeddings=False,
        )
        return transformers.MixtralForCausalLM, cfg
    raise SystemExit(f"unknown family {family!r}; valid: {', '.join(FAMILIES)}")


def make_model(cls, cfg):
    model = cls._from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    assert model.config._attn_implementation == "eager", model.config._attn_implementation
    return model.eval()


@torch.no_grad()
def randomize(model, seed):
    """Re-draw every weight: matrices ~ N(0, 1/fan_in), embeddings ~ N(0, 0.25^2),
    biases and norm parameters = init + N(0, 0.2^2). Tied tensors are drawn once."""
    gen = torch.Generator().manual_seed(seed)

    def normal_(p, std):
        p.copy_(torch.randn(p.shape, generator=gen) * std)

    seen = set()
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            if isinstance(module, torch.nn.Embedding):
                normal_(p, 0.25)
            elif isinstance(module, torch.nn.Linear) and name == "weight":
                normal_(p, p.shape[1] ** -0.5)  # torch Linear weight is [out, in]
            elif isinstance(module, Conv1D) and name == "weight":
                normal_(p, p.shape[0] ** -0.5)  # GPT-2 Conv1D weight is [in, out]
            elif p.ndim == 3:  # MoE experts stacked on E, each [out, in] like torch Linear
                normal_(p, p.shape[2] ** -0.5)
            elif "Router" in type(module).__name__ and name == "weight":  # MoE router [E, M]
                normal_(p, p.shape[1] ** -0.5)
            elif p.ndim == 1:  # biases, RMSNorm/LayerNorm scales and LayerNorm biases
                p.add_(torch.randn(p.shape, generator=gen) * 0.2)
            else:
                raise ValueError(f"no rule for {type(module).__name__}.{name} {tuple(p.shape)}")


@torch.no_grad()
def logits_of(model, input_ids):
    out = model(input_ids=torch.from_numpy(input_ids).long())
    return out.logits.float().numpy()


@torch.no_grad()
def aux_loss_of(model, input_ids):
    """transformers' load-balancing loss (unweighted) over all layers, no padding."""
    out = model(input_ids=torch.from_numpy(input_ids).long(), output_router_logits=True)
    return np.float32(out.aux_loss.item())


def make_inputs(vocab_size, seed):
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab_size, size=(BATCH, SEQ_LEN)).astype(np.int32)


@torch.no_grad()
def attended_keys(family, layer_type=None):
    """Which earlier tokens the last query sees in a 1-layer model, found by perturbation:
    change token j, see whether the last position's logits move. Returns sorted offsets
    (query - key), so a window of W keys including the query itself reads [0 .. W-1]."""
    cls, cfg = build_config(family)
    cfg.num_hidden_layers = 1
    if layer_type is not None:
        cfg.layer_types = [layer_type]
    torch.manual_seed(SEED + 100)
    model = make_model(cls, cfg)
    randomize(model, SEED + 100)
    ids = make_inputs(cfg.vocab_size, SEED + 100)[:1]
    base = logits_of(model, ids)[0, -1]
    last = ids.shape[1] - 1
    offsets = []
    for j in range(ids.shape[1]):
        moved = ids.copy()
        moved[0, j] = (moved[0, j] + 1) % cfg.vocab_size
        if np.abs(logits_of(model, moved)[0, -1] - base).max() > 1e-6:
            offsets.append(last - j)
    return sorted(offsets)


def ablation_diff(cls, cfg, model, input_ids, ref, edit):
    """Max logit change when one config field is changed and the same weights are kept: proves
    the feature under test is really active in the reference (a no-op feature tests nothing)."""
    cfg2 = copy.deepcopy(cfg)
    edit(cfg2)
    model2 = make_model(cls, cfg2)
    model2.load_state_dict(model.state_dict())
    return float(np.abs(logits_of(model2, input_ids) - ref).max())


def ablations(family):
    if family == "llama":
        return {
            "rope llama3 -> default": lambda c: setattr(
                c, "rope_parameters", dict(rope_type="default", rope_theta=500000.0)
            )
        }
    if family == "qwen3_moe":
        return {"norm_topk_prob -> True": lambda c: setattr(c, "norm_topk_prob", True)}
    if family == "mixtral":
        return {"num_experts_per_tok -> 1": lambda c: setattr(c, "num_experts_per_tok", 1)}
    if family == "mistral":
        return {"sliding_window -> None": lambda c: setattr(c, "sliding_window", None)}
    if family == "gemma3":
        return {
            "sliding_window -> 4096": lambda c: setattr(c, "sliding_window", 4096),
            "final_logit_softcapping -> None": lambda c: setattr(
                c, "final_logit_softcapping", None
            ),
            "local rope_theta -> global's": lambda c: c.rope_parameters["sliding_attention"].update(
                rope_theta=1000000.0
            ),
            "query_pre_attn_scalar -> head_dim": lambda c: setattr(
                c, "query_pre_attn_scalar", c.head_dim
            ),
        }
    return {}


def generate(family):
    out_dir = os.path.join(HERE, family)
    os.makedirs(out_dir, exist_ok=True)
    for name in os.listdir(out_dir):  # stale shards from an earlier layout must not linger
        os.remove(os.path.join(out_dir, name))
    cls, cfg = build_config(family)
    torch.manual_seed(SEED)
    model = make_model(cls, cfg)
    randomize(model, SEED)
    input_ids = make_inputs(cfg.vocab_size, SEED + 1)
    ref = logits_of(model, input_ids)
    assert ref.dtype == np.float32 and np.isfinite(ref).all()

    kwargs = {"max_shard_size": SHARDED[family]} if family in SHARDED else {}
    model.save_pretrained(out_dir, safe_serialization=True, **kwargs)
    gen_cfg = os.path.join(out_dir, "generation_config.json")
    if os.path.exists(gen_cfg):
        os.remove(gen_cfg)
    extra = {"aux_loss": aux_loss_of(model, input_ids)} if family in MOE_FAMILIES else {}
    np.savez(
        os.path.join(out_dir, "inputs_and_logits.npz"), input_ids=input_ids, logits=ref, **extra
    )

    print(f"== {family}: {cls.__name__}, logits {ref.shape}, |logits| max {np.abs(ref).max():.3f}")
    if extra:
        print(f"   aux_loss {float(extra['aux_loss']):.6f}")
    for what, edit in ablations(family).items():
        diff = ablation_diff(cls, cfg, model, input_ids, ref, edit)
        print(f"   ablation {what}: max logit change {diff:.4f}")
        assert diff > 1e-3, f"{family}: {what} does not change the logits"
    # The saved checkpoint must reproduce the logits exactly: validates the --check-export path.
    diff = check_export(out_dir, family)
    assert diff == 0.0, diff
    if family in LAYER_FAMILIES:
        add_layer_outputs(family)


def check_export(ckpt_dir, family):
    """Load ckpt_dir with transformers, return max |logits - reference| on the saved inputs."""
    cls, _ = build_config(family)
    data = np.load(os.path.join(HERE, family, "inputs_and_logits.npz"))
    model, info = cls.from_pretrained(
        ckpt_dir, attn_implementation="eager", dtype=torch.float32, output_loading_info=True
    )
    problems = {k: v for k, v in info.items() if v and k != "error_msgs"}
    if info.get("error_msgs") or problems.get("missing_keys") or problems.get("mismatched_keys"):
        raise SystemExit(f"{ckpt_dir}: checkpoint does not match {cls.__name__}: {info}")
    if problems.get("unexpected_keys"):
        raise SystemExit(f"{ckpt_dir}: unexpected tensors {sorted(problems['unexpected_keys'])}")
    logits = logits_of(model.eval(), data["input_ids"])
    return float(np.abs(logits - data["logits"]).max())


# Families whose per-layer outputs the parity tests check (Llama-lineage module names).
LAYER_FAMILIES = ("llama", "qwen3", "mistral", "gemma3")
# The committed logits were made by another torch build; re-running the committed checkpoint
# must reproduce them to float32 rounding, or the layer outputs would describe another model.
LAYERS_RERUN_TOL = 1e-5


@torch.no_grad()
def add_layer_outputs(family):
    """Run the committed checkpoint on the committed input_ids and add to its npz what layer 0
    sees and returns: `embed_out` (the hidden state entering layer 0, Gemma's sqrt(M) scale
    included), `attn0_in` (input_layernorm's output), `attn0_out` (self_attn's output, before
    any post-norm and the residual add) and `block0_out` (layer 0's output). Arrays already in
    the npz are written back unchanged (checked bit for bit); weights are not touched."""
    out_dir = os.path.join(HERE, family)
    npz_path = os.path.join(out_dir, "inputs_and_logits.npz")
    with np.load(npz_path) as f:
        existing = {k: f[k] for k in f.files}
    cls, _ = build_config(family)
    model = cls.from_pretrained(out_dir, attn_implementation="eager", dtype=torch.float32).eval()
    layer = model.model.layers[0]
    seen = {}

    def first_tensor(value):
        return value[0] if isinstance(value, tuple) else value

    def keep(name):
        return lambda module, args, out: seen.__setitem__(name, first_tensor(out).float().numpy())

    def keep_input(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        seen["embed_out"] = hidden.float().numpy()

    hooks = [
        layer.register_forward_pre_hook(keep_input, with_kwargs=True),
        layer.input_layernorm.register_forward_hook(keep("attn0_in")),
        layer.self_attn.register_forward_hook(keep("attn0_out")),
        layer.register_forward_hook(keep("block0_out")),
    ]
    logits = logits_of(model, existing["input_ids"])
    for h in hooks:
        h.remove()
    diff = float(np.abs(logits - existing["logits"]).max())
    assert diff <= LAYERS_RERUN_TOL, f"{family}: the committed checkpoint now gives logits {diff}"
    base = {k: v for k, v in existing.items() if k in ("input_ids", "logits")}
    np.savez(npz_path, **base, **{k: seen[k].astype(np.float32) for k in sorted(seen)})
    with np.load(npz_path) as f:
        for k, v in base.items():
            assert f[k].dtype == v.dtype and f[k].tobytes() == v.tobytes(), (family, k)
    print(f"== {family}: rerun logits within {diff:.1e}; added {', '.join(sorted(seen))}")


def describe(family):
    """Tensor names and shapes as safetensors.numpy reads them (what our loaders see)."""
    out_dir = os.path.join(HERE, family)
    tensors = {}
    for name in sorted(os.listdir(out_dir)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(out_dir, name)))
    with open(os.path.join(out_dir, "config.json")) as f:
        arch = json.load(f)["architectures"]
    lines = [f"### {family} ({', '.join(arch)})", "", "```"]
    for name in sorted(tensors, key=_natural_key):
        t = tensors[name]
        lines.append(f"{name:48s} {str(t.dtype):8s} {list(t.shape)}")
    lines += ["```", ""]
    return "\n".join(lines)


def _natural_key(name):
    return [int(s) if s.isdigit() else s for s in name.replace(".", " . ").split()]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", choices=FAMILIES, action="append")
    parser.add_argument("--check-export", metavar="DIR", help="compare DIR's logits to the ref")
    parser.add_argument("--describe", action="store_true", help="print tensor names and shapes")
    parser.add_argument("--layers", action="store_true", help="add per-layer outputs to the npz")
    args = parser.parse_args()
    families = args.family or list(FAMILIES)

    if args.check_export:
        if len(families) != 1:
            parser.error("--check-export needs exactly one --family")
        diff = check_export(args.check_export, families[0])
        ok = diff <= CHECK_TOL
        print(f"{families[0]}: max abs logit diff {diff:.3e} ({'ok' if ok else 'FAIL'}, tol 1e-4)")
        sys.exit(0 if ok else 1)
    if args.describe:
        print("\n".join(describe(f) for f in families))
        return
    if args.layers:
        for family in args.family or LAYER_FAMILIES:
            add_layer_outputs(family)
        return

    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    for family in families:
        generate(family)
    for family in ("mistral", "gemma3"):
        if family not in families:
            continue
        kinds = ["sliding_attention", "full_attention"] if family == "gemma3" else [None]
        for kind in kinds:
            offs = attended_keys(family, kind)
            label = f"{family} {kind or ''}".strip()
            print(f"   {label}: last query sees offsets {offs[0]}..{offs[-1]} ({len(offs)} keys)")
            expected = WINDOW if kind != "full_attention" else SEQ_LEN
            contiguous = offs == list(range(len(offs)))
            assert contiguous and len(offs) == expected, (label, offs)


if __name__ == "__main__":
    main()
