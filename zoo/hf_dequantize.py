"""The hub's quantized checkpoints, dequantized to float32 as they are read.

A checkpoint whose config.json has a `quantization_config` is read through a reader that
wraps `CheckpointReader` (zoo/safetensors_io.py) and shows the mapping layer
(zoo/hf_io.py) plain float tensors under the names of the family's BF16 checkpoint: a
quantized tensor's scales are hidden, and reading the tensor returns it dequantized. One
tensor at a time, so the host never holds the model twice. Which methods a family takes is
its `HfFormat.quantizations`.

- `fp8` (DeepSeek-V3, Kimi K2): each quantized `X.weight` is F8_E4M3 with a float32
  `X.weight_scale_inv` of shape [ceil(out/bm), ceil(in/bn)], (bm, bn) the config's
  `weight_block_size`; the weight is w * scale, the scale repeated over its bm x bn block and
  cropped at the edges (transformers' `finegrained_fp8._dequantize_fp8_weight`).
- `mxfp4` (GPT-OSS): each `X_blocks` is U8 [E, R, G, B], two FP4 e2m1 values per byte, low
  nibble first, and `X_scales` U8 [E, R, G] a power of two per 2B values (2^(s - 127)); `X`
  is [E, G * 2B, R], transformers' `mxfp4.convert_moe_packed_tensors` in float32, which is
  the layout of the BF16 checkpoint's `gate_up_proj` and `down_proj`.

What is not one of these (per-tensor FP8, UE8M0 scales, another method) is a one-line
UsageError when config.json is read; a quantized tensor without its scale, or a scale of the
wrong shape, one when the checkpoint is opened, before any tensor is read.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from nnx_zoo.errors import UsageError

FP8 = "fp8"
MXFP4 = "mxfp4"
METHODS = {
    FP8: "FP8 e4m3 weights with per-block float32 scales (DeepSeek-V3, Kimi K2)",
    MXFP4: "MXFP4 experts (GPT-OSS)",
}

_FLOAT_DTYPES = ("F32", "BF16", "F16")
_FP8_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}
# byte -> float32, for each FP8 format: a table lookup is ~3x ml_dtypes' cast on one core
# and gives the same bits.
_FP8_TABLES = {
    name: np.arange(256, dtype=np.uint8).view(dt).astype(np.float32)
    for name, dt in _FP8_DTYPES.items()
}
_SCALE_SUFFIX = "_scale_inv"

# transformers' mxfp4.FP4_VALUES: the e2m1 value of each nibble.
_FP4_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    np.float32,
)
# byte -> its two values, low nibble first, as the 8 bytes of one uint64: one lookup per byte
# (4x a [256, 2] table's fancy indexing).
_FP4_PAIR_BITS = (
    np.stack([_FP4_VALUES[np.arange(256) & 0xF], _FP4_VALUES[np.arange(256) >> 4]], -1)
    .view(np.uint64)
    .ravel()
)
_STRIP = 64  # rows of one expert dequantized at a time
# scale byte -> 2^(s - 127) in float32, as torch.ldexp computes it (x * 2.0**e): 2^128 is inf.
with np.errstate(over="ignore"):
    _E8M0 = np.ldexp(np.float32(1), np.arange(256) - 127).astype(np.float32)


def _valid() -> str:
    return "; ".join(f"{k}: {v}" for k, v in METHODS.items())


def check_quantization(hf: dict, family: str, accepted: tuple[str, ...], where: str) -> None:
    """UsageError (one line) unless config.json's quantization_config, if any, is a method
    `family` takes in a form read here."""
    quant = hf.get("quantization_config")
    if not quant:
        return
    if not isinstance(quant, dict):
        raise UsageError(f"{where}: quantization_config is not a JSON object")
    method = quant.get("quant_method")
    if method not in accepted:
        takes = ", ".join(f"{m} ({METHODS[m]})" for m in accepted) or "none (BF16/F32 only)"
        raise UsageError(
            f"{where}: quantization_config quant_method={method!r} is not read for {family}; "
            f"valid: {takes}"
        )
    if method == FP8:
        _check_fp8(quant, where)


def _check_fp8(quant: dict, where: str) -> None:
    block = quant.get("weight_block_size")
    ok = isinstance(block, list | tuple) and len(block) == 2
    if not ok or not all(type(b) is int and b > 0 for b in block):
        raise UsageError(
            f"{where}: fp8 quantization_config weight_block_size={block!r} is not supported; "
            "valid: two positive integers such as [128, 128] (per-block scales; per-tensor "
            "FP8 is not read)"
        )
    if quant.get("scale_fmt") not in (None, "float"):
        raise UsageError(
            f"{where}: fp8 quantization_config scale_fmt={quant['scale_fmt']!r} is not "
            "supported; valid: float (float32 scales), or absent"
        )
    if quant.get("fmt", "e4m3") != "e4m3":
        raise UsageError(
            f"{where}: fp8 quantization_config fmt={quant['fmt']!r} is not supported; valid: e4m3"
        )
    if quant.get("activation_scheme", "dynamic") != "dynamic":
        raise UsageError(
            f"{where}: fp8 quantization_config activation_scheme="
            f"{quant['activation_scheme']!r} is not supported; valid: dynamic"
        )


def dequantizing_reader(reader, hf: dict, family):
    """`reader` as the mapping layer reads it: itself for an unquantized checkpoint, else
    wrapped to dequantize. `hf`: the checkpoint's config.json; `family`: its Family."""
    check_quantization(hf, family.name, family.hf.quantizations, str(reader))
    quant = hf.get("quantization_config")
    if not quant:
        return reader
    if quant["quant_method"] == FP8:
        return Fp8BlockReader(reader, tuple(quant["weight_block_size"]))
    return Mxfp4Reader(reader)


class _Wrapped:
    """The CheckpointReader surface over `inner`, with some names dequantized on read."""

    def __init__(self, inner):
        self.inner = inner
        self._shapes: dict[str, tuple[int, ...]] = {}  # dequantized name -> its shape
        self._names: list[str] = []

    def __str__(self) -> str:
        return str(self.inner)

    def names(self) -> list[str]:
        return list(self._names)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name] if name in self._shapes else self.inner.shape(name)

    def dtype(self, name: str) -> str:
        return "F32" if name in self._shapes else self.inner.dtype(name)

    def read(self, name: str) -> np.ndarray:
        return self._dequantize(name) if name in self._shapes else self.inner.read(name)

    def _dequantize(self, name: str) -> np.ndarray:
        raise NotImplementedError


class Fp8BlockReader(_Wrapped):
    """Every FP8 tensor `X` times its `X_scale_inv`, per (bm, bn) block of its last two dims."""

    def __init__(self, inner, block: tuple[int, int]):
        super().__init__(inner)
        self.block = block
        names = inner.names()
        present = set(names)
        for name in names:
            if name.endswith(_SCALE_SUFFIX):
                weight = name.removesuffix(_SCALE_SUFFIX)
                if weight not in present or inner.dtype(weight) not in _FP8_DTYPES:
                    raise UsageError(
                        f"{inner}: {name} scales {weight}, which is "
                        f"{'absent' if weight not in present else inner.dtype(weight)}; "
                        f"valid: a scale beside an {'/'.join(_FP8_DTYPES)} tensor"
                    )
                continue
            self._names.append(name)
            if inner.dtype(name) in _FP8_DTYPES:
                self._check_scale(name, present)
                self._shapes[name] = inner.shape(name)

    def _check_scale(self, name: str, present: set[str]) -> None:
        scale = name + _SCALE_SUFFIX
        shape = self.inner.shape(name)
        if scale not in present:
            raise UsageError(
                f"{self.inner}: {name} is {self.inner.dtype(name)} without its {scale}; "
                "valid: each FP8 tensor beside its float32 block scales"
            )
        if len(shape) < 2:
            raise UsageError(
                f"{self.inner}: {name} is FP8 of shape {shape}; valid: a matrix (..., out, in)"
            )
        want = (*shape[:-2], *(-(-d // b) for d, b in zip(shape[-2:], self.block, strict=True)))
        if self.inner.shape(scale) != want:
            raise UsageError(
                f"{self.inner}: {scale} has shape {self.inner.shape(scale)}; valid for {name} "
                f"{shape} with weight_block_size {list(self.block)}: {want}"
            )
        if self.inner.dtype(scale) not in _FLOAT_DTYPES:
            raise UsageError(
                f"{self.inner}: {scale} is {self.inner.dtype(scale)}; valid: "
                f"{', '.join(_FLOAT_DTYPES)}"
            )

    def _dequantize(self, name: str) -> np.ndarray:
        w = self.inner.read(name)
        scale = self.inner.read(name + _SCALE_SUFFIX).astype(np.float32)
        return dequantize_fp8(w, scale, self.block)


def dequantize_fp8(w: np.ndarray, scale: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """(..., out, in) FP8 times float32 scales (..., ceil(out/bm), ceil(in/bn)) per block.

    transformers' `_dequantize_fp8_weight` in float32: one float32 multiply per element."""
    out = _FP8_TABLES[_fp8_name(w.dtype)].take(w.view(np.uint8))
    bm, bn = block
    rows, cols = out.shape[-2:]
    full, rem = divmod(cols, bn)
    # The scales repeated over rows only; over columns they broadcast through a view.
    scale_RC = np.repeat(scale.astype(np.float32, copy=False), bm, axis=-2)[..., :rows, :]
    head = out[..., : full * bn].reshape(*out.shape[:-1], full, bn)
    head *= scale_RC[..., :full, None]
    if rem:
        out[..., full * bn :] *= scale_RC[..., full:]
    return out


def _fp8_name(dtype) -> str:
    for name, dt in _FP8_DTYPES.items():
        if np.dtype(dt) == dtype:
            return name
    raise TypeError(f"not an FP8 dtype: {dtype}")


class Mxfp4Reader(_Wrapped):
    """Every `X_blocks` / `X_scales` pair read as `X`, dequantized into the BF16 layout."""

    def __init__(self, inner):
        super().__init__(inner)
        names = inner.names()
        present = set(names)
        for name in names:
            if name.endswith("_scales"):
                blocks = name.removesuffix("_scales") + "_blocks"
                if blocks not in present:
                    raise UsageError(
                        f"{inner}: {name} without its {blocks}; valid: MXFP4 scales beside "
                        "their U8 blocks"
                    )
                continue
            if not name.endswith("_blocks"):
                self._names.append(name)
                continue
            base = name.removesuffix("_blocks")
            if base in present:
                raise UsageError(f"{inner}: holds both {base} and its MXFP4 {name}")
            self._shapes[base] = self._check(name, base + "_scales", present)
            self._names.append(base)

    def _check(self, blocks: str, scales: str, present: set[str]) -> tuple[int, ...]:
        inner = self.inner
        shape = inner.shape(blocks)
        if inner.dtype(blocks) != "U8" or len(shape) != 4:
            raise UsageError(
                f"{inner}: {blocks} is {inner.dtype(blocks)} of shape {shape}; valid: MXFP4 "
                "blocks, U8 [experts, rows, groups, bytes]"
            )
        if scales not in present:
            raise UsageError(
                f"{inner}: {blocks} without its {scales}; valid: MXFP4 blocks beside their U8 "
                "scales"
            )
        if inner.dtype(scales) != "U8" or inner.shape(scales) != shape[:-1]:
            raise UsageError(
                f"{inner}: {scales} is {inner.dtype(scales)} of shape {inner.shape(scales)}; "
                f"valid for {blocks} {shape}: U8 {shape[:-1]}"
            )
        experts, rows, groups, per_group = shape
        return (experts, groups * 2 * per_group, rows)

    def _dequantize(self, name: str) -> np.ndarray:
        blocks = self.inner.read(name + "_blocks")
        return dequantize_mxfp4(blocks, self.inner.read(name + "_scales"))


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """U8 blocks [E, R, G, B] and scales [E, R, G] -> float32 [E, G * 2B, R].

    transformers' `convert_moe_packed_tensors(..., dtype=float32)`: each nibble's e2m1 value
    times 2^(scale - 127), one float32 multiply, then rows and columns swapped per expert.
    Done a strip of rows at a time: the temporaries stay in cache and the swap is written
    as strips (numpy's whole-matrix transposed copy is 4x slower)."""
    experts, rows, groups, per_group = blocks.shape
    cols = groups * 2 * per_group
    out = np.empty((experts, cols, rows), np.float32)
    for e in range(experts):
        for r0 in range(0, rows, _STRIP):
            r1 = min(r0 + _STRIP, rows)
            values = _FP4_PAIR_BITS.take(blocks[e, r0:r1]).view(np.float32)
            values = values.reshape(r1 - r0, groups, 2 * per_group)
            with np.errstate(over="ignore"):  # scale 254 or 255 overflows, to inf as in torch
                values *= _E8M0[scales[e, r0:r1]][..., None]
            out[e, :, r0:r1] = values.reshape(r1 - r0, cols).T
    return out
