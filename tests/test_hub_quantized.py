"""The hub's quantized checkpoints read dequantized (zoo/hf_dequantize.py): DeepSeek-V3's FP8
weights with 128x128 block scales, GPT-OSS's MXFP4 experts.

Tiny checkpoints are quantized here in the published formats (numpy and ml_dtypes), then:
our dequantization equals transformers' own functions bit for bit; loading the quantized
checkpoint gives the very params and logits of loading a float copy of its dequantized
weights (written by a naive dequantizer of this file); what is not read is refused in one line.
"""

from __future__ import annotations

import json
import re
import struct

import _entry
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from model_utils import host_params, one_device_mesh

import zoo
from nnx_zoo.errors import UsageError
from zoo import hf_dequantize, hf_io

FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448
FP4 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
_ST_DTYPES = {
    np.dtype(np.float32): "F32",
    np.dtype(ml_dtypes.bfloat16): "BF16",
    np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3",
    np.dtype(np.uint8): "U8",
}
T = 12


# --- checkpoints in the published formats ---------------------------------------------------


def _write_safetensors(path, tensors: dict[str, np.ndarray]) -> None:
    """safetensors by hand: safetensors.numpy writes no FP8 (numpy has none)."""
    header, offset = {}, 0
    for name, x in tensors.items():
        header[name] = {
            "dtype": _ST_DTYPES[x.dtype],
            "shape": list(x.shape),
            "data_offsets": [offset, offset + x.nbytes],
        }
        offset += x.nbytes
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for x in tensors.values():
            f.write(np.ascontiguousarray(x).tobytes())


def _write_checkpoint(path, config: dict, tensors: dict[str, np.ndarray]) -> str:
    path.mkdir()
    _write_safetensors(path / hf_io.SINGLE_FILE, tensors)
    (path / hf_io.CONFIG_FILE).write_text(json.dumps(config))
    return str(path)


def _quantize_fp8(w_OI: np.ndarray, block) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek's per-block FP8: scale = amax / 448 per (bm, bn) block, w / scale in e4m3."""
    bm, bn = block
    rows, cols = w_OI.shape
    R, C = -(-rows // bm), -(-cols // bn)
    padded = np.zeros((R * bm, C * bn), np.float32)
    padded[:rows, :cols] = w_OI
    amax = np.abs(padded.reshape(R, bm, C, bn)).max(axis=(1, 3))
    scale_RC = (np.maximum(amax, 1e-12) / FP8_MAX).astype(np.float32)
    full = np.repeat(np.repeat(scale_RC, bm, 0), bn, 1)[:rows, :cols]
    q = np.clip(w_OI / full, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
    return q, scale_RC


def _naive_fp8(q, scale_RC, block) -> np.ndarray:
    bm, bn = block
    rows, cols = q.shape
    return q.astype(np.float32) * np.repeat(np.repeat(scale_RC, bm, 0), bn, 1)[:rows, :cols]


def _quantize_mxfp4(w_ECR: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A BF16-layout expert tensor [E, C, R] as OpenAI's MXFP4: per expert and row r, groups
    of 32 along C share 2^(s - 127), the largest power of two with amax / 2^e <= 6, and each
    value is the nearest e2m1, two per byte, low nibble first."""
    w_ERC = np.swapaxes(w_ECR, 1, 2)
    E, R, C = w_ERC.shape
    groups = w_ERC.reshape(E, R, C // 32, 32)
    amax = np.abs(groups).max(-1)
    exp = np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)).astype(np.int32)
    scales = np.clip(exp + 127, 1, 254).astype(np.uint8)
    scaled = groups / np.ldexp(1.0, scales.astype(np.int32) - 127)[..., None]
    nibbles = np.abs(scaled[..., None] - FP4).argmin(-1).astype(np.uint8)
    blocks = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
    return blocks, scales


def _naive_mxfp4(blocks, scales) -> np.ndarray:
    E, R, G, B = blocks.shape
    values = np.empty((E, R, G, 2 * B), np.float32)
    values[..., 0::2] = FP4[blocks & 0xF]
    values[..., 1::2] = FP4[blocks >> 4]
    values *= (2.0 ** (scales.astype(np.float32) - 127))[..., None]
    return np.swapaxes(values.reshape(E, R, G * 2 * B), 1, 2)


def _float_checkpoint(preset: str, tmp_path) -> tuple[dict, dict]:
    """A random model of `preset` as (config.json, {hf name: bf16 array})."""
    cfg = zoo.get_config(preset)
    with jax.set_mesh(one_device_mesh()):
        model = zoo.create_model(cfg, "dp", rngs=nnx.Rngs(0))
        zoo.save_pretrained(model, str(tmp_path))
    reader = hf_io.CheckpointReader(str(tmp_path))
    rng = np.random.default_rng(0)
    tensors = {}
    for name in reader.names():
        x = reader.read(name)
        # Norms start at ones, biases at zero: random, so a wrong tensor shows.
        if "norm" in name or "bias" in name or "sinks" in name:
            x = rng.normal(1.0 if "norm" in name else 0.0, 0.1, x.shape).astype(np.float32)
        tensors[name] = x.astype(ml_dtypes.bfloat16)
    return hf_io.read_hf_config(str(tmp_path)), tensors


def _logits(model) -> np.ndarray:
    ids_BT = np.random.default_rng(1).integers(0, model.cfg.vocab_size, (2, T))
    with jax.set_mesh(one_device_mesh()):
        return np.asarray(
            model(
                jnp.asarray(ids_BT, jnp.int32),
                segment_ids=jnp.ones((2, T), jnp.int32),
                positions=jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (2, T)),
            )
        )


def _load(path):
    with jax.set_mesh(one_device_mesh()):
        return zoo.from_pretrained(path, "dp")


# DeepSeek's block is 128x128; the tiny model's dims are all below 128, so the checkpoint
# uses 32x16 blocks: several per tensor, and cropped edges (kv_a's 24 rows, kv_b's 16 columns).
FP8_BLOCK = (32, 16)
FP8_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": list(FP8_BLOCK),
}
# Quantized, as in the hub's checkpoint: every projection but the router; this one is kept
# in BF16 (listed in modules_to_not_convert) to show both kinds side by side.
NOT_CONVERTED = "model.layers.0.self_attn.o_proj"
_FP8_NAME = re.compile(r"model\.layers\.\d+\..*_proj(_with_mqa)?\.weight")


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """(quantized dir, float copy dir, {hf name: (fp8, scale)})."""
    root = tmp_path_factory.mktemp("deepseek")
    config, tensors = _float_checkpoint("deepseek-v3-tiny", root / "float32")
    quantized, dequantized, pairs = {}, {}, {}
    for name, x in tensors.items():
        if _FP8_NAME.fullmatch(name) and not name.startswith(NOT_CONVERTED + "."):
            q, scale = _quantize_fp8(x.astype(np.float32), FP8_BLOCK)
            quantized[name], quantized[name + "_scale_inv"] = q, scale
            dequantized[name] = _naive_fp8(q, scale, FP8_BLOCK)
            pairs[name] = (q, scale)
        else:
            quantized[name] = dequantized[name] = x
    qconfig = {**config, "quantization_config": {**FP8_CONFIG, "modules_to_not_convert": []}}
    qconfig["quantization_config"]["modules_to_not_convert"] = [NOT_CONVERTED]
    return (
        _write_checkpoint(root / "fp8", qconfig, quantized),
        _write_checkpoint(root / "dequantized", config, dequantized),
        pairs,
    )


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """(quantized dir, float copy dir, {hf name: (blocks, scales)})."""
    root = tmp_path_factory.mktemp("gpt_oss")
    config, tensors = _float_checkpoint("gpt-oss-tiny", root / "float32")
    quantized, dequantized, pairs = {}, {}, {}
    for name, x in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = _quantize_mxfp4(x.astype(np.float32))
            quantized[name + "_blocks"], quantized[name + "_scales"] = blocks, scales
            dequantized[name] = _naive_mxfp4(blocks, scales)
            pairs[name] = (blocks, scales)
        else:
            quantized[name] = dequantized[name] = x
    # openai/gpt-oss-20b's quantization_config.
    not_converted = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens"]
    quant = {"quant_method": "mxfp4", "modules_to_not_convert": [*not_converted, "lm_head"]}
    return (
        _write_checkpoint(root / "mxfp4", {**config, "quantization_config": quant}, quantized),
        _write_checkpoint(root / "dequantized", config, dequantized),
        pairs,
    )


# --- (a) the dequantization equals transformers' bit for bit --------------------------------


def _bits_equal(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert a.shape == b.shape
    np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize(
    "shape, block, fmt",
    [
        ((576, 7168), (128, 128), "e4m3fn"),
        ((200, 300), (128, 128), "e4m3fn"),
        ((3, 70, 45), (32, 16), "e4m3fn"),
        ((200, 300), (128, 128), "e5m2"),
    ],
    ids=["kv_a_proj", "cropped", "stacked", "e5m2"],
)
def test_fp8_equals_transformers_bit_for_bit(shape, block, fmt):
    """Every FP8 bit pattern but NaN's (subnormals and both zeros included); DeepSeek-V3's
    kv_a_proj_with_mqa is [576, 7168] (576 = 4.5 blocks)."""
    torch = pytest.importorskip("torch", reason="the reference is transformers'")
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    dtype = getattr(ml_dtypes, f"float8_{fmt}")
    rng = np.random.default_rng(0)
    q = rng.integers(0, 256, shape, dtype=np.uint8).view(dtype)
    q[np.isnan(q.astype(np.float32))] = 0
    scale_shape = (*shape[:-2], *(-(-d // b) for d, b in zip(shape[-2:], block, strict=True)))
    scale = rng.uniform(1e-4, 1e-1, scale_shape).astype(np.float32)
    ours = hf_dequantize.dequantize_fp8(q, scale, block)
    theirs = fp8._dequantize_fp8_weight(
        torch.from_numpy(q.view(np.uint8).copy()).view(getattr(torch, f"float8_{fmt}")),
        torch.from_numpy(scale),
        list(block),
        torch.float32,
    )
    _bits_equal(ours, theirs.numpy())


def test_mxfp4_equals_transformers_bit_for_bit():
    """Every byte and every scale byte but 255 (2^128: inf, and 0 * inf); gpt-oss-20b's
    groups per row (90) and bytes per group (16)."""
    torch = pytest.importorskip("torch", reason="the reference is transformers'")
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 40, 90, 16), dtype=np.uint8)
    scales = rng.integers(0, 255, (3, 40, 90), dtype=np.uint8)
    ours = hf_dequantize.dequantize_mxfp4(blocks, scales)
    theirs = mxfp4.convert_moe_packed_tensors(
        torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32
    )
    assert ours.shape == (3, 90 * 32, 40)
    _bits_equal(ours, theirs.numpy())


# --- (b) a quantized checkpoint loads as its float copy -------------------------------------


@pytest.mark.parametrize("family", ["deepseek", "gpt_oss"])
def test_quantized_loads_as_its_float_copy(family, request):
    """The same float32 params, bit for bit, and so the same logits."""
    quantized_dir, float_dir, _ = request.getfixturevalue(family)
    quantized, reference = _load(quantized_dir), _load(float_dir)
    want = host_params(reference)
    got = host_params(quantized)
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    np.testing.assert_array_equal(_logits(quantized), _logits(reference))


def test_the_reader_shows_the_bf16_checkpoint(deepseek, gpt_oss):
    """Scales and blocks hidden; the dequantized tensors named, shaped and typed as in the
    BF16 checkpoint; our dequantization equals this file's naive one."""
    for path, float_dir, pairs in (deepseek, gpt_oss):
        config = hf_io.read_hf_config(path)
        fam = zoo.hf_mapping.family_and_config(path, {})[0]
        reader = hf_dequantize.dequantizing_reader(hf_io.CheckpointReader(path), config, fam)
        plain = hf_io.CheckpointReader(float_dir)
        assert sorted(reader.names()) == sorted(plain.names())
        for name in pairs:
            assert reader.shape(name) == plain.shape(name) and reader.dtype(name) == "F32"
            _bits_equal(reader.read(name), plain.read(name))


def test_transformers_loads_the_fp8_checkpoint_to_the_same_logits(deepseek):
    """transformers 5 dequantizing the same tiny FP8 checkpoint on CPU, where it can: float32
    against float32, summation order only (2e-4, as tests/test_deepseek_v3.py)."""
    torch = pytest.importorskip("torch", reason="the reference is transformers'")
    transformers = pytest.importorskip("transformers")
    path = deepseek[0]
    try:
        model = transformers.DeepseekV3ForCausalLM.from_pretrained(
            path,
            quantization_config=transformers.FineGrainedFP8Config(dequantize=True),
            dtype=torch.float32,
        ).eval()
    except (ValueError, RuntimeError) as e:
        pytest.skip(f"transformers cannot load it here: {str(e).splitlines()[0][:200]}")
    ids_BT = np.random.default_rng(1).integers(0, model.config.vocab_size, (2, T))
    with torch.no_grad():
        want = model(torch.as_tensor(ids_BT)).logits.float().numpy()
    got = _logits(_load(path))
    rel = np.abs(got - want).max() / np.abs(want).max()
    assert rel < 2e-4


# --- (c) what is not read is refused in one line --------------------------------------------


def _refused(fn, match):
    with pytest.raises(UsageError, match=match) as info:
        fn()
    assert "\n" not in str(info.value)


def _edited(src, tmp_path, name, edit_tensors=None, edit_quant=None) -> str:
    reader = hf_io.CheckpointReader(src)
    tensors = {n: np.array(reader.read(n)) for n in reader.names()}
    config = hf_io.read_hf_config(src)
    if edit_tensors:
        tensors = edit_tensors(tensors)
    if edit_quant:
        config["quantization_config"] = edit_quant(dict(config["quantization_config"]))
    return _write_checkpoint(tmp_path / name, config, tensors)


@pytest.mark.parametrize(
    "edit, match",
    [
        (
            lambda q: {**q, "weight_block_size": None},
            r"weight_block_size=None is not supported; valid: two positive integers .*per-tensor",
        ),
        (
            lambda q: {**q, "scale_fmt": "ue8m0"},
            r"scale_fmt='ue8m0' is not supported; valid: float",
        ),
        (lambda q: {**q, "fmt": "e5m2"}, r"fmt='e5m2' is not supported; valid: e4m3"),
        (
            lambda q: {**q, "activation_scheme": "static"},
            r"activation_scheme='static' is not supported; valid: dynamic",
        ),
        (
            lambda q: {"quant_method": "gptq", "bits": 4},
            r"quant_method='gptq' is not read for deepseek_v3; valid: fp8 \(FP8 e4m3",
        ),
        (
            lambda q: {"quant_method": "mxfp4"},
            r"quant_method='mxfp4' is not read for deepseek_v3; valid: fp8 ",
        ),
    ],
    ids=["per_tensor", "ue8m0", "e5m2", "static", "unknown", "other_family_method"],
)
def test_fp8_config_refusals(deepseek, tmp_path, edit, match):
    path = _edited(deepseek[0], tmp_path, "bad", edit_quant=edit)
    _refused(lambda: hf_io.read_config(path), match)
    _refused(lambda: _load(path), match)


def test_other_families_refuse_any_quantization(tmp_path):
    config = zoo.hf_mapping.config_to_hf(zoo.get_config("tiny"))
    config["quantization_config"] = FP8_CONFIG
    (tmp_path / "config.json").write_text(json.dumps(config))
    _refused(
        lambda: hf_io.read_config(str(tmp_path)),
        r"quant_method='fp8' is not read for llama; valid: none \(BF16/F32 only\)",
    )


def test_fp8_tensor_refusals(deepseek, tmp_path):
    name = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"  # [24, 64]: scales [1, 4]
    scale = name + "_scale_inv"
    without = _edited(
        deepseek[0], tmp_path, "no_scale", lambda t: {k: v for k, v in t.items() if k != scale}
    )
    _refused(
        lambda: _load(without),
        re.escape(f"{name} is F8_E4M3 without its {scale}; valid: each FP8 tensor beside"),
    )
    misshapen = _edited(deepseek[0], tmp_path, "bad_shape", lambda t: {**t, scale: t[scale][:, :2]})
    _refused(
        lambda: _load(misshapen),
        re.escape(
            f"{scale} has shape (1, 2); valid for {name} (24, 64) with weight_block_size "
            "[32, 16]: (1, 4)"
        ),
    )
    bf16 = "model.layers.0.self_attn.o_proj.weight"
    stray = _edited(deepseek[0], tmp_path, "stray", lambda t: {**t, bf16 + "_scale_inv": t[scale]})
    _refused(lambda: _load(stray), re.escape(f"{bf16}_scale_inv scales {bf16}, which is BF16"))


def test_mxfp4_tensor_refusals(gpt_oss, tmp_path):
    name = "model.layers.0.mlp.experts.gate_up_proj"  # blocks [8, 128, 2, 16]
    blocks, scales = name + "_blocks", name + "_scales"
    without = _edited(
        gpt_oss[0], tmp_path, "no_scales", lambda t: {k: v for k, v in t.items() if k != scales}
    )
    _refused(lambda: _load(without), re.escape(f"{blocks} without its {scales}; valid: MXFP4"))
    misshapen = _edited(gpt_oss[0], tmp_path, "bad", lambda t: {**t, scales: t[scales][:, :, :1]})
    _refused(
        lambda: _load(misshapen),
        re.escape(f"{scales} is U8 of shape (8, 128, 1); valid for {blocks} (8, 128, 2, 16): U8"),
    )


def test_eval_main_exits_2_on_ue8m0(deepseek, tmp_path):
    path = _edited(deepseek[0], tmp_path, "ue8m0", edit_quant=lambda q: {**q, "scale_fmt": "ue8m0"})
    result = _entry.evaluate(
        [f"--workdir={tmp_path / 'run'}", f"--hf_checkpoint={path}", "--tokenizer=byte"]
    )
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "scale_fmt='ue8m0' is not supported" in lines[0], result.stderr
