"""Quantized projections (zoo/layers/quant.py) against the float32 einsum on random inputs.

The bound is the format's, per output element: with |Q(a) - a| <= e_a elementwise,
    |Q(x).Q(w) - x.w| <= sum_k e_x |w| + |x| e_w + e_x e_w,
plus float32 accumulation slack (1e-5 relative to sum |x||w|). Per element:
  fp8 e4m3 (3 mantissa bits): e = max(2^-4 |a|, 2^-10 s) (half an ulp; 2^-10 s is half the
      subnormal spacing, s = amax / 448 the tensor's scale); e5m2 (2 bits): max(2^-3 |a|,
      2^-17 s), s = amax / 57344;
  int8: e = s / 2 with s = amax / 127 of the row / column the element belongs to.
Every output must sit inside its bound, and the error must be there (not a float path).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from zoo.layers import quant
from zoo.layers.basic import Einsum

EQ = "BTM,MND->BTND"  # a q projection: M contracted
B, T, M, N, D = 4, 16, 64, 4, 8


def _inputs(seed=0):
    kx, kw, kg = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (B, T, M), jnp.float32)
    x = x * jnp.exp(jax.random.normal(kg, (B, T, 1)))  # rows of different sizes
    w = 0.05 * jax.random.normal(kw, (M, N, D), jnp.float32)
    return x, w


def _proj(quantization):
    return jax.jit(lambda x, w: quant.qeinsum(EQ, quantization, None, x, w))


def _element_error(a, quantization, grad=False, contract_axes=()):
    a = np.asarray(a, np.float64)
    if quantization == "int8":
        amax = np.max(np.abs(a), axis=contract_axes, keepdims=True)
        return np.broadcast_to(amax / 127 / 2, a.shape)
    dtype = quant.FP8_BACKWARD if grad else quant.FP8_FORWARD
    info = jnp.finfo(dtype)
    scale = np.max(np.abs(a)) / float(info.max)
    half_ulp = 2.0 ** -(info.nmant + 1)
    return np.maximum(half_ulp * np.abs(a), float(info.smallest_subnormal) / 2 * scale)


def _bound(eq, x, w, ex, ew):
    ax, aw = np.abs(np.asarray(x, np.float64)), np.abs(np.asarray(w, np.float64))
    bound = np.einsum(eq, ex, aw) + np.einsum(eq, ax, ew) + np.einsum(eq, ex, ew)
    return bound + 1e-5 * np.einsum(eq, ax, aw)


@pytest.mark.parametrize("quantization", ["fp8", "int8"])
def test_forward_within_the_formats_bound(quantization):
    x, w = _inputs()
    y = np.asarray(_proj(quantization)(x, w), np.float64)
    ref = np.einsum(EQ, np.asarray(x, np.float64), np.asarray(w, np.float64))
    ex = _element_error(x, quantization, contract_axes=(2,))
    ew = _element_error(w, quantization, contract_axes=(0,))
    err, bound = np.abs(y - ref), _bound(EQ, x, w, ex, ew)
    assert np.all(err <= bound), float(np.max(err / bound))
    # Quantized for real: the error is of the format's size, not float32's.
    assert np.max(err / np.abs(ref).max()) > 1e-4


@pytest.mark.parametrize("quantization", ["fp8", "int8"])
def test_gradients_within_the_formats_bound(quantization):
    """dx = Q(dy).Q(w) and dw = Q(x).Q(dy) (straight-through quantizers), each against the
    float32 product with the bound of its operands' formats."""
    x, w = _inputs(1)
    dy = jax.random.normal(jax.random.key(2), (B, T, N, D), jnp.float32)
    dx, dw = jax.jit(lambda x, w, dy: jax.vjp(_proj(quantization), x, w)[1](dy))(x, w, dy)
    f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
    eq_dx, eq_dw = "BTND,MND->BTM", "BTM,BTND->MND"
    # dx contracts N, D: dy per (B, T) row, w per M row. dw contracts B, T.
    ed = _element_error(dy, quantization, grad=True, contract_axes=(2, 3))
    ew = _element_error(w, quantization, contract_axes=(1, 2))
    err = np.abs(f64(dx) - np.einsum(eq_dx, f64(dy), f64(w)))
    assert np.all(err <= _bound(eq_dx, dy, w, ed, ew))
    ex = _element_error(x, quantization, contract_axes=(0, 1))
    ed = _element_error(dy, quantization, grad=True, contract_axes=(0, 1))
    err = np.abs(f64(dw) - np.einsum(eq_dw, f64(x), f64(dy)))
    assert np.all(err <= _bound(eq_dw, x, dy, ex, ed))


def test_fp8_is_the_dot_of_the_fp8_values():
    """The fp8 dot is exactly the float32 einsum of the dequantized e4m3 operands (CPU)."""
    x, w = _inputs(3)
    xq, wq = quant.quantize(x, quant.FP8_FORWARD), quant.quantize(w, quant.FP8_FORWARD)
    assert xq.q.dtype == jnp.float8_e4m3fn and xq.scale.shape == ()
    ref = jnp.einsum(EQ, xq.q.astype(jnp.float32), wq.q.astype(jnp.float32)) * (xq.scale * wq.scale)
    np.testing.assert_allclose(_proj("fp8")(x, w), ref, rtol=1e-6, atol=0)


def test_int8_values_and_scales():
    x, _ = _inputs(4)
    q = quant.quantize(x, jnp.int8, (2,))
    assert q.q.dtype == jnp.int8 and q.scale.shape == (B, T, 1)
    assert int(jnp.max(jnp.abs(q.q.astype(jnp.int32)))) == 127  # each row spans the grid
    dequantized = q.q.astype(jnp.float32) * q.scale  # the value each int8 stands for
    np.testing.assert_allclose(dequantized, x, atol=float(q.scale.max()))


def test_zero_input_gives_zero_not_nan():
    w = jnp.ones((M, N, D))
    for quantization in ("fp8", "int8"):
        y = _proj(quantization)(jnp.zeros((B, T, M)), w)
        assert not np.any(np.isnan(y)) and not np.any(y)


@pytest.mark.parametrize("quantization", ["fp8", "int8"])
def test_sharded_projection_equals_one_device(quantization):
    """x split over `data`, w over `data` (contracted) and `model`: scales are global (amax
    all-reduced), so the values equal one device's up to float32 summation order."""
    x, w = _inputs(5)
    proj = lambda x, w: quant.qeinsum(EQ, quantization, None, x, w)  # noqa: E731
    y0, (gx0, gw0) = jax.value_and_grad(lambda x, w: jnp.sum(proj(x, w) ** 2), (0, 1))(x, w)
    mesh = jax.make_mesh(
        (4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Explicit,) * 2
    )
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, P("data", None, None))
        ws = jax.device_put(w, P("data", "model", None))
        out = P("data", None, "model", None)

        def loss(x, w):
            return jnp.sum(quant.qeinsum(EQ, quantization, out, x, w) ** 2)

        y, (gx, gw) = jax.jit(jax.value_and_grad(loss, (0, 1)))(xs, ws)
        assert jax.typeof(gx).sharding.spec == P("data", None, None)
        assert jax.typeof(gw).sharding.spec == P("data", "model", None)
    np.testing.assert_allclose(y, y0, rtol=1e-5)
    np.testing.assert_allclose(gx, gx0, rtol=1e-4, atol=1e-5 * float(jnp.abs(gx0).max()))
    np.testing.assert_allclose(gw, gw0, rtol=1e-4, atol=1e-5 * float(jnp.abs(gw0).max()))


def test_einsum_module_runs_quantized_and_refuses_unknown_values():
    layer = Einsum(EQ, (M, N, D), _sharding(), rngs=nnx.Rngs(0), quantization="int8")
    x, _ = _inputs(6)
    ref = jnp.einsum(EQ, x, layer.weight[...])
    y = layer(x)
    assert 0 < float(jnp.max(jnp.abs(y - ref))) < 0.05 * float(jnp.max(jnp.abs(ref)))
    with pytest.raises(ValueError, match="quantization='fp4'; valid: none, fp8, int8"):
        Einsum(EQ, (M, N, D), _sharding(), rngs=nnx.Rngs(0), quantization="fp4")


def _sharding():
    from shardings.specs import LinearSharding

    return LinearSharding(weight=None, out=None)
