"""Low-precision projections: an einsum whose operands are quantized, forward and backward.

    quantization   forward x, w          backward dy (both dx and dw)   scales
    'none'         compute dtype         compute dtype                  -
    'fp8'          float8_e4m3fn         float8_e5m2                    one per tensor, current
    'int8'         int8 (int32 accum.)   int8 (int32 accum.)            one per row / column

Current scaling: each scale is taken from the tensor being quantized, in the same step
(`amax / max_representable`), so there is no scaling state (no amax history) to checkpoint,
and a resumed run is the uninterrupted one bit for bit. (Delayed scaling, the other fp8
recipe, keeps an amax history per tensor; not built.)

fp8 is a dot whose operands are the fp8 arrays themselves (`f8e4m3fn x f8e4m3fn` forward,
`f8e5m2 x f8e4m3fn` / `f8e4m3fn x f8e5m2` backward), accumulated in the compute dtype's
precision, with the two per-tensor scales multiplied into the result. Compiled for H100, XLA
makes it an fp8 GEMM: a Triton GEMM fusion on fp8 operands by default, or cuBLASLt's
`__cublas$lt$matmul$f8` with `--xla_gpu_enable_triton_gemm=false`. (The other spelling,
dequantize `convert(f8) * scale` then a bf16 dot, becomes the cuBLASLt fp8 call only with
Triton GEMMs off; with them on, XLA fuses it into a bf16 GEMM: checked by compiling.) CPU runs
the same dot on the same fp8 values. cuBLASLt takes one scale per operand: per-tensor scales.

int8 is an integer dot (`s8 x s8 -> s32`), the MXU's int8 path on TPU, with the scales applied
to the int32 result. A scale is taken per slice along the contracting dims (per token row of
x, per output column of w), so it factors out of the sum exactly; the backward dots contract
other dims, so they requantize from the compute-dtype values they keep (x and w).

Gradients are those of the quantized forward pass with the quantizers passed straight through
(the usual "quantized training" recipe): dx = Q(dy) . Q(w), dw = Q(x) . Q(dy), with Q the
quantizer of each backward dot.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from nnx_zoo.errors import UsageError
from shardings.specs import normalize

QUANTIZATIONS = ("none", "fp8", "int8")
FP8_FORWARD = jnp.float8_e4m3fn  # 3 mantissa bits, max 448: weights and activations
FP8_BACKWARD = jnp.float8_e5m2  # 2 mantissa bits, max 57344: gradients need the range
INT8_MAX = 127  # symmetric: -127..127 (-128 unused, so the grid is symmetric around 0)


# Inside a pipeline stage, fp8 projections keep their unquantized operands for the backward
# pass, as int8's do (set while the stage is traced; see `unquantized_residuals`).
_UNQUANTIZED_RESIDUALS = contextvars.ContextVar("unquantized_residuals", default=False)


@contextlib.contextmanager
def unquantized_residuals():
    """fp8 projections traced inside keep x and w, not their fp8 copies, for the backward.

    The pipeline (zoo/layers/pipeline.py) slices each layer's weights from the stage's stack
    under a name its remat policy never saves, so the backward re-slices them; an fp8 copy
    of w would be a new array, saved once per iteration: a copy of the stage's weights per
    micro-batch, what the pipeline exists to avoid. (Also measured on the XLA CPU backend,
    jax 0.10.2 and 0.12.0.1: fp8 residuals carried through the pipeline's iteration loop
    turned the tiny model's loss into NaN under value_and_grad while the plain forward was
    finite; with x and w kept it equals the one-device run.)"""
    token = _UNQUANTIZED_RESIDUALS.set(True)
    try:
        yield
    finally:
        _UNQUANTIZED_RESIDUALS.reset(token)


def check(quantization: str) -> None:
    if quantization not in QUANTIZATIONS:
        raise UsageError(
            f"quantization={quantization!r}; valid: {', '.join(QUANTIZATIONS)} (fp8: e4m3 "
            "forward, e5m2 gradients, per-tensor scales; int8: per-row/column scales)"
        )


def describe(quantization: str) -> str:
    """One line for explain_main: what the projections compute in, and what state it keeps."""
    return {
        "none": "none: every matmul in the compute dtype",
        "fp8": (
            "fp8: q/k/v/o and MLP projections take float8_e4m3fn operands forward and "
            "float8_e5m2 gradients backward, one scale per tensor from its current amax "
            "(no scaling state: nothing extra in the checkpoint); LM head, attention core, "
            "MoE router and experts in the compute dtype"
        ),
        "int8": (
            "int8: q/k/v/o and MLP projections take int8 operands (int32 accumulation) "
            "forward and backward, one scale per row/column from its current amax (no "
            "scaling state: nothing extra in the checkpoint); LM head, attention core, MoE "
            "router and experts in the compute dtype"
        ),
    }[quantization]


class Quantized(NamedTuple):
    q: jax.Array  # the low-precision values
    scale: jax.Array  # float32; scalar (per tensor) or keepdims over the contracting dims


def quantize(x, dtype, contract_axes: tuple[int, ...] = ()) -> Quantized:
    """x ~= q * scale. fp8: one scale for the tensor. int8: one per slice over `contract_axes`.

    A zero slice gets scale 1 (its q is 0 either way)."""
    x32 = x.astype(jnp.float32)
    if jnp.issubdtype(dtype, jnp.integer):
        top = float(INT8_MAX)
        amax = jnp.max(jnp.abs(x32), axis=contract_axes, keepdims=True)
    else:
        top = float(jnp.finfo(dtype).max)
        amax = jnp.max(jnp.abs(x32))
    scale = jnp.where(amax > 0, amax / top, 1.0)
    scaled = jnp.clip(x32 / scale, -top, top)  # e4m3fn has no inf: overflow would be NaN
    if jnp.issubdtype(dtype, jnp.integer):
        scaled = jnp.round(scaled)
    return Quantized(scaled.astype(dtype), scale)


def _letters(eq: str) -> tuple[str, str, str]:
    ins, out = eq.replace(" ", "").split("->")
    a, b = ins.split(",")
    return a, b, out


def _contract_axes(operand: str, out: str) -> tuple[int, ...]:
    return tuple(i for i, c in enumerate(operand) if c not in out)


def _spec_of(x) -> P | None:
    sharding = jax.typeof(x).sharding
    if sharding is None or sharding.mesh.empty:
        return None
    return sharding.spec


def _scale_to_out(scale, operand: str, out: str, out_spec: P | None):
    """A keepdims scale of `operand` laid out as the output `out`: contracted dims dropped,
    kept dims in the output's order, size-1 dims for the other operand's, and the output's
    layout (so the multiply needs no collective beyond moving a vector)."""
    contracted = _contract_axes(operand, out)
    s = jnp.squeeze(scale, axis=contracted)
    kept = [c for c in operand if c in out]
    s = jnp.transpose(s, [kept.index(c) for c in out if c in kept])
    s = jnp.expand_dims(s, [i for i, c in enumerate(out) if c not in kept])
    if out_spec is not None:
        parts = normalize(out_spec, len(out))
        spec = P(*(p if c in kept else None for p, c in zip(parts, out, strict=True)))
        s = jax.sharding.reshard(s, spec)
    return s


def _dot(eq: str, a: Quantized, b: Quantized, out_spec, dtype):
    """The einsum of two quantized operands, in `dtype`."""
    if jnp.issubdtype(a.q.dtype, jnp.integer):
        acc = jnp.einsum(eq, a.q, b.q, preferred_element_type=jnp.int32, out_sharding=out_spec)
        la, lb, out = _letters(eq)
        spec = out_spec if out_spec is not None else _spec_of(acc)
        y = acc.astype(jnp.float32) * _scale_to_out(a.scale, la, out, spec)
        return (y * _scale_to_out(b.scale, lb, out, spec)).astype(dtype)
    # fp8: a dot of the fp8 operands themselves (per-tensor scales applied to the result).
    # XLA GPU compiles it to an fp8 GEMM (Triton's, or cuBLASLt's `__cublas$lt$matmul$f8`
    # with Triton GEMMs off); the dequantize-then-dot form is left a bf16 Triton GEMM.
    y = jnp.einsum(eq, a.q, b.q, preferred_element_type=dtype, out_sharding=out_spec)
    return y * (a.scale * b.scale).astype(dtype)


def _formats(quantization: str):
    """(forward dtype, gradient dtype)."""
    return (FP8_FORWARD, FP8_BACKWARD) if quantization == "fp8" else (jnp.int8, jnp.int8)


def _q(x, dtype, eq_operand: str, eq_out: str) -> Quantized:
    return quantize(x, dtype, _contract_axes(eq_operand, eq_out))


def qeinsum(eq: str, quantization: str, out_spec, x, w):
    """`einsum(eq, x, w)` with both operands quantized (`quantization` 'fp8' | 'int8'), in
    x's dtype, laid out as `out_spec`. Differentiable: the backward dots are quantized too."""
    # Read while the model is traced: the forward rule is traced later, by differentiation,
    # outside any context the caller set.
    keep_quantized = quantization == "fp8" and not _UNQUANTIZED_RESIDUALS.get()
    return _qeinsum(eq, quantization, out_spec, keep_quantized, x, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _qeinsum(eq: str, quantization: str, out_spec, keep_quantized: bool, x, w):
    return _forward(eq, quantization, out_spec, keep_quantized, x, w)[0]


def _forward(eq, quantization, out_spec, keep_quantized, x, w):
    if x.dtype != w.dtype:
        raise ValueError(f"quantized einsum {eq!r}: x is {x.dtype}, w is {w.dtype}; cast both")
    fwd_dtype, _ = _formats(quantization)
    a, b, out = _letters(eq)
    xq, wq = _q(x, fwd_dtype, a, out), _q(w, fwd_dtype, b, out)
    y = _dot(eq, xq, wq, out_spec, x.dtype)
    # fp8 keeps the quantized operands (half of bf16's bytes); their per-tensor scales serve
    # every dot. int8 keeps x and w, since the backward dots contract other dims; so does fp8
    # inside a pipeline stage (`unquantized_residuals`).
    saved = (xq, wq) if keep_quantized else (x, w)
    return y, saved


def _backward(eq, quantization, out_spec, keep_quantized, saved, dy):
    fwd_dtype, grad_dtype = _formats(quantization)
    a, b, out = _letters(eq)
    eq_dx, eq_dw = f"{out},{b}->{a}", f"{a},{out}->{b}"
    if quantization == "fp8":
        # x, w and dy share the compute dtype (`_forward` checks x and w). Kept unquantized
        # (a pipeline stage), they are quantized again exactly as the forward pass did.
        xq, wq = saved
        if not keep_quantized:
            xq, wq = _q(xq, fwd_dtype, a, out), _q(wq, fwd_dtype, b, out)
        dyq = quantize(dy, grad_dtype)
        dx = _dot(eq_dx, dyq, wq, _spec_of(xq.q), dy.dtype)
        dw = _dot(eq_dw, xq, dyq, _spec_of(wq.q), dy.dtype)
        return dx, dw
    x, w = saved
    dx = _dot(eq_dx, _q(dy, grad_dtype, out, a), _q(w, fwd_dtype, b, a), _spec_of(x), x.dtype)
    dw = _dot(eq_dw, _q(x, fwd_dtype, a, b), _q(dy, grad_dtype, out, b), _spec_of(w), w.dtype)
    return dx, dw


_qeinsum.defvjp(_forward, _backward)


def check_equation(eq: str) -> None:
    """The backward equations need every operand dim in the other operand or the output."""
    a, b, out = _letters(eq)
    for name, operand, other in (("x", a, b), ("w", b, a)):
        alone = [c for c in operand if c not in other and c not in out]
        if alone:
            raise ValueError(f"quantized einsum {eq!r}: {name}'s dims {alone} are summed alone")
