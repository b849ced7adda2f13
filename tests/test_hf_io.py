"""Checkpoint directories: config.json formats, tensor checks with one-line errors, dtypes,
name variants, atomic export. No forward pass here (test_zoo_parity.py runs those)."""

from __future__ import annotations

import json
import pathlib
import re

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

import zoo
from shardings import get_strategy
from zoo import hf_io

REF = pathlib.Path(__file__).parent / "hf_reference"


def _copy(family, tmp_path, edit_tensors=None, edit_config=None) -> str:
    """The reference checkpoint of `family` as one model.safetensors, optionally edited."""
    out = tmp_path / f"{family}-edited"
    out.mkdir()
    reader = hf_io.CheckpointReader(str(REF / family))
    tensors = {name: np.array(reader.read(name)) for name in reader.names()}
    config = hf_io.read_hf_config(str(REF / family))
    if edit_tensors:
        tensors = edit_tensors(tensors)
    if edit_config:
        config = edit_config(config)
    save_file(tensors, str(out / hf_io.SINGLE_FILE))
    (out / hf_io.CONFIG_FILE).write_text(json.dumps(config))
    return str(out)


def _load(path, strategy_name="fsdp_tp"):
    strategy = get_strategy(strategy_name)
    with jax.set_mesh(strategy.make_mesh(shape=(4, 2) if strategy_name == "fsdp_tp" else None)):
        return zoo.from_pretrained(path, strategy)


def _params(model):
    return {
        "/".join(map(str, p)): np.asarray(v.get_value())
        for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }


def _one_line_error(fn, match):
    with pytest.raises(ValueError, match=match) as info:
        fn()
    assert "\n" not in str(info.value)


# --- errors ---------------------------------------------------------------------------------


def test_unsupported_architecture(tmp_path):
    def falcon(c):
        return {**c, "architectures": ["FalconForCausalLM"], "model_type": "falcon"}

    path = _copy("llama", tmp_path, edit_config=falcon)
    _one_line_error(
        lambda: _load(path),
        r"unsupported architecture FalconForCausalLM; supported: .*LlamaForCausalLM",
    )


def test_missing_tensor(tmp_path):
    name = "model.layers.1.mlp.up_proj.weight"
    path = _copy(
        "qwen3", tmp_path, edit_tensors=lambda t: {k: v for k, v in t.items() if k != name}
    )
    _one_line_error(lambda: _load(path), f"missing tensor {name.replace('.', '[.]')} in")


def test_misshapen_tensor(tmp_path):
    name = "model.layers.1.mlp.up_proj.weight"
    path = _copy("llama", tmp_path, edit_tensors=lambda t: {**t, name: t[name][:, :32]})
    _one_line_error(
        lambda: _load(path), re.escape(f"{name}: expected shape (64, 64), found (64, 32)")
    )


def test_misshapen_fused_tensor(tmp_path):
    name = "transformer.h.0.attn.c_attn.bias"
    path = _copy("gpt2", tmp_path, edit_tensors=lambda t: {**t, name: t[name][:128]})
    _one_line_error(lambda: _load(path), re.escape(f"{name}: expected shape (192,), found (128,)"))


def test_unexpected_tensor(tmp_path):
    name = "model.layers.0.self_attn.extra_proj.weight"
    path = _copy("mistral", tmp_path, edit_tensors=lambda t: {**t, name: np.zeros((4,), "f4")})
    _one_line_error(lambda: _load(path), re.escape(f"unexpected tensor {name} in"))


def test_unsupported_rope_type(tmp_path):
    def longrope(c):
        return {**c, "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "factor": 4.0}}

    path = _copy("mistral", tmp_path, edit_config=longrope)
    _one_line_error(lambda: hf_io.read_config(path), "rope_type 'longrope' is not supported")


def test_config_our_format_cannot_express():
    _one_line_error(
        lambda: hf_io.config_to_hf(zoo.get_config("tiny", qk_norm=True)),
        r"LlamaConfig.qk_norm=True cannot be written as a LlamaForCausalLM config.json",
    )


def test_how_a_model_runs_is_not_written_nor_checked():
    # zoo.layers.config.RUNTIME_FIELDS, one tuple: a pipeline run's config (its micro-batches)
    # or an expert exchange's is still a Llama config.json.
    runtime = {"pipeline_microbatches": 4, "pipeline_repeats": 2, "moe_exchange": "padded"}
    hf = hf_io.config_to_hf(zoo.get_config("tiny", **runtime))
    assert hf["architectures"] == ["LlamaForCausalLM"] and not set(runtime) & set(hf)


# --- config.json formats --------------------------------------------------------------------


def test_transformers4_config_formats_read_like_5(tmp_path):
    """Hub configs written by transformers 4.x: top-level rope_theta / rope_scaling, and for
    Gemma 3 rope_local_base_freq and sliding_window_pattern instead of layer_types."""

    def llama_v4(c):
        c = dict(c)
        rope = dict(c.pop("rope_parameters"))
        c["rope_theta"] = rope.pop("rope_theta")
        c["rope_scaling"] = {"type" if k == "rope_type" else k: v for k, v in rope.items()}
        return c

    def gemma_v4(c):
        c = {k: v for k, v in c.items() if k not in ("rope_parameters", "layer_types")}
        return {**c, "rope_theta": 1e6, "rope_local_base_freq": 1e4, "rope_scaling": None}

    for family, edit in (("llama", llama_v4), ("gemma3", gemma_v4)):
        path = _copy(family, tmp_path, edit_config=edit)
        assert "rope_parameters" not in hf_io.read_hf_config(path)
        assert hf_io.read_config(path) == hf_io.read_config(str(REF / family)), family


def test_reference_configs():
    llama = hf_io.read_config(str(REF / "llama"))
    assert llama.rope_scaling == (8.0, 1.0, 4.0, 256) and not llama.tie_embeddings
    gemma = hf_io.read_config(str(REF / "gemma3"))
    assert gemma.layer_windows() == [8, 0, 8]
    assert (gemma.rope_theta, gemma.rope_local_theta) == (1e6, 1e4)
    assert gemma.attn_scale == 24**-0.5 and gemma.final_logit_softcap == 10.0
    assert hf_io.read_config(str(REF / "mistral")).layer_windows() == [8, 8]
    assert hf_io.read_config(str(REF / "qwen3")).layer_windows() == [0, 0]
    gpt2 = hf_io.read_config(str(REF / "gpt2"))
    assert (gpt2.ffn_dim, gpt2.max_seq_len, gpt2.head_dim) == (128, 32, 16)
    # Runtime fields come from the caller.
    assert hf_io.read_config(str(REF / "qwen3"), dtype="bfloat16").dtype == "bfloat16"


def test_presets_have_their_published_sizes():
    # Parameter counts as transformers reports them (tied heads counted once).
    expected = {
        "gpt2": 124_439_808,
        "gpt2-medium": 354_823_168,
        "qwen3-0.6b": 596_049_920,
        "qwen3-8b": 8_190_735_360,
        "mistral-7b-v0.1": 7_241_732_096,
        "gemma3-1b": 999_885_952,
        "llama3.1-8b": 8_030_261_248,
        "llama3.1-70b": 70_553_706_496,
    }
    for name, count in expected.items():
        assert zoo.get_config(name).num_params() == count, name


# --- tensors --------------------------------------------------------------------------------


def test_bfloat16_checkpoint_loads_as_float32(tmp_path):
    """Hub checkpoints are mostly bf16, which safetensors' numpy reader rejects."""

    def to_bf16(t):
        return {k: v.astype(ml_dtypes.bfloat16) for k, v in t.items()}

    model = _load(_copy("gpt2", tmp_path, edit_tensors=to_bf16))
    reference = _params(_load(str(REF / "gpt2")))
    for path, value in _params(model).items():
        assert value.dtype == np.float32
        rounded = reference[path].astype(ml_dtypes.bfloat16).astype(np.float32)
        assert np.array_equal(value, rounded), path


def test_gpt2_hub_names_without_prefix_and_with_mask_buffers(tmp_path):
    def hub_style(t):
        out = {k.removeprefix("transformer."): v for k, v in t.items()}
        for i in range(2):
            out[f"h.{i}.attn.bias"] = np.tril(np.ones((1, 1, 32, 32), np.float32))
            out[f"h.{i}.attn.masked_bias"] = np.array(-1e4, np.float32)
        return out

    model = _load(_copy("gpt2", tmp_path, edit_tensors=hub_style), "dp")
    reference = _params(_load(str(REF / "gpt2"), "dp"))
    loaded = _params(model)
    assert loaded.keys() == reference.keys()
    for path in reference:
        assert np.array_equal(loaded[path], reference[path]), path


def test_unscanned_layers_load_and_export_like_stacked(tmp_path):
    model = _load(str(REF / "qwen3"), "dp")
    strategy = get_strategy("dp")
    with jax.set_mesh(strategy.make_mesh()):
        listed = zoo.from_pretrained(str(REF / "qwen3"), strategy, scan_layers=False)
    stacked, unstacked = _params(model), _params(listed)
    for path, value in unstacked.items():
        parts = path.split("/")
        if parts[0] == "blocks":
            value_stacked = stacked["/".join(["blocks", *parts[2:]])][int(parts[1])]
            assert np.array_equal(value, value_stacked), path
    zoo.save_pretrained(listed, str(tmp_path / "out"))
    exported = hf_io.CheckpointReader(str(tmp_path / "out"))
    reference = hf_io.CheckpointReader(str(REF / "qwen3"))
    assert sorted(exported.names()) == sorted(reference.names())
    for name in reference.names():
        assert np.array_equal(exported.read(name), reference.read(name)), name


def test_save_replaces_a_directory_whole(tmp_path):
    model = _load(str(REF / "mistral"), "dp")
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "stale.safetensors").write_bytes(b"old")
    zoo.save_pretrained(model, str(out))
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no temporary left beside it


def test_from_pretrained_needs_a_mesh():
    _one_line_error(lambda: zoo.from_pretrained(str(REF / "llama"), "dp"), "needs a mesh")


def test_mesh_that_does_not_divide_fails_before_loading(tmp_path):
    # GPT-2's 4 heads over a model axis of 8.
    strategy = get_strategy("tp")
    with (
        jax.set_mesh(strategy.make_mesh(shape=(1, 8))),
        pytest.raises(ValueError, match="divisible|divide"),
    ):
        zoo.from_pretrained(str(REF / "gpt2"), strategy)
