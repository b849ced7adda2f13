"""The tiled grouped matmul (zoo/layers/grouped_matmul.py, the MoE experts' form on GPU) equals
`jax.lax.ragged_dot`: alone (values and gradients, empty groups, rows past the groups, rows
not a multiple of the tile), and in the MoE layer under fsdp_ep on 2 x 4 devices (its
gradients' sums over the data axis). On the h100 target its temporaries do not grow with the
experts where ragged_dot's do (XLA:GPU lowers ragged_dot densely over every expert).

Tolerance: float32; both compute each row's products, in another blocking: 1e-5 relative.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_zoo.planning.targets import target_devices
from shardings import get_strategy
from zoo import get_config
from zoo.layers import grouped_matmul as gm
from zoo.layers.moe import Moe

RTOL = 1e-5


def _close(got, want):
    scale = max(float(np.abs(want).max()), 1e-6)
    assert float(np.abs(np.asarray(got) - np.asarray(want)).max()) / scale < RTOL


@pytest.mark.parametrize(
    "X,E,tile,sizes",
    [
        (300, 5, 32, [100, 0, 90, 0, 103]),  # empty groups; 7 rows past the groups
        (64, 8, 16, [8, 8, 8, 8, 8, 8, 8, 8]),  # every tile shared by two experts
        (40, 16, 8, [0] * 15 + [40]),  # one expert holds every row
        (257, 3, 128, [0, 0, 0]),  # no rows at all: zeros
    ],
)
def test_tiled_equals_ragged_dot(X, E, tile, sizes):
    rng = np.random.default_rng(X)
    M, F = 8, 12
    x = jnp.asarray(rng.normal(size=(X, M)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(E, M, F)), jnp.float32)
    c = jnp.asarray(rng.normal(size=(X, F)), jnp.float32)
    g = jnp.asarray(sizes, jnp.int32)

    def value_and_grads(form):
        def loss(x, w):
            y = gm.grouped_matmul(x, w, g, form, tile)
            return jnp.sum(y * c), y

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, w)

    (_, y_ref), grads_ref = value_and_grads("ragged_dot")
    (_, y), grads = value_and_grads("tiled")
    np.testing.assert_array_equal(np.asarray(y)[sum(sizes) :], 0)
    _close(y, y_ref)
    for got, want in zip(grads, grads_ref, strict=True):
        _close(got, want)


def test_moe_layer_under_fsdp_ep_equals_ragged_dot(monkeypatch):
    """gpt-oss-tiny's MoE layer (biases, clamped activation) on data 2 x expert 4: output
    and gradients (input, experts, biases, router) with the tiled form equal ragged_dot's."""
    monkeypatch.setattr(gm, "TILE", 8)  # several tiles per device's rows
    cfg = get_config("gpt-oss-tiny")
    strategy = get_strategy("fsdp_ep")
    mesh = strategy.make_mesh(shape=(2, 4))
    B, T = 8, 16
    x_BTM = np.random.default_rng(0).normal(size=(B, T, cfg.hidden_dim)).astype(np.float32)
    with jax.set_mesh(mesh):
        moe = nnx.jit(lambda r: Moe(cfg, strategy.lm_sharding().block.moe, rngs=r))(nnx.Rngs(0))
        x = jax.device_put(x_BTM, strategy.lm_sharding().block.moe.tokens)

        def run():
            def loss(m, x):
                y, _ = m(x, np.ones((B, T), bool))
                return jnp.sum(y * y), y

            grad = nnx.grad(loss, argnums=(0, 1), has_aux=True)
            return nnx.jit(grad)(moe, x)

        (g_moe_ref, g_x_ref), y_ref = run()
        with gm.force_matmul("tiled"):
            (g_moe, g_x), y = run()
    _close(y, y_ref)
    _close(g_x, g_x_ref)
    want = dict(nnx.to_flat_state(g_moe_ref))
    for path, got in nnx.to_flat_state(g_moe):
        _close(got.get_value(), want[path].get_value())


def _temp_mib(form, E, grad):
    mesh = jax.sharding.Mesh(np.array(target_devices("h100:8")[:1]), ("d",))
    X, M, F = 2048, 1024, 512

    def f(x, w, g):
        if grad:
            y = lambda x, w: jnp.sum(gm.grouped_matmul(x, w, g, form).astype(jnp.float32))  # noqa: E731
            return jax.grad(y, argnums=(0, 1))(x, w)
        return gm.grouped_matmul(x, w, g, form)

    def s(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))

    args = (s((X, M), jnp.bfloat16), s((E, M, F), jnp.bfloat16), s((E,), jnp.int32))
    return jax.jit(f).lower(*args).compile().memory_analysis().temp_size_in_bytes / 2**20


def test_h100_temporaries_do_not_grow_with_experts_x_rows():
    """ragged_dot's forward temporaries on XLA:GPU are rows x experts x M (4 MiB an expert
    here); the tiled form's stay under one expert's worth, and its backward adds only a
    float32 gradient accumulator the size of the experts' matrices."""
    assert gm.resolve_matmul("auto", "gpu") == "tiled"
    assert gm.resolve_matmul("auto", "tpu") == gm.resolve_matmul("auto", "cpu") == "ragged_dot"
    assert gm.resolve_matmul("ragged_dot", "gpu") == "ragged_dot"
    ragged = {E: _temp_mib("ragged_dot", E, grad=False) for E in (4, 16)}
    assert ragged[16] - ragged[4] >= 12 * 4  # each expert adds a bf16 copy of the rows
    tiled = {E: _temp_mib("tiled", E, grad=False) for E in (4, 16)}
    assert tiled[16] == tiled[4] < 4
    weights_f32_mib = 16 * 1024 * 512 * 4 / 2**20
    grads = {form: _temp_mib(form, 16, grad=True) for form in ("ragged_dot", "tiled")}
    assert grads["tiled"] < weights_f32_mib + 16 < grads["ragged_dot"]
