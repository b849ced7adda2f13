"""Every pipeline schedule (GPipe, circular, 1F1B) on a toy stage -- a few lines of jnp, no
model -- equals the sequential composition of its layers, forward and gradients, on the 8
simulated CPU devices with a `stage` mesh axis: S = 2, 3 and 4 stages, as many micro-batches
as stages and more (the circular schedule's ring wraps round from the last stage to the
first; 1F1B's residual ring of 2S-1 slots wraps when Mb > 2S-1).

The toy layer is non-finite on a zero input (`log` of its rows' mean square), and a bubble
iteration runs on zeros: the schedules must keep every bubble's values and gradients out of
the results (a gradient product with a zero cotangent would not: 0 x inf is NaN).

Micro-batch counts that are not a multiple of S are refused by `pipeline.plan` (the rows leave
the pipeline split over `stage` by whole micro-batches), checked in one line here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from nnx_zoo.errors import UsageError
from zoo.layers import pipeline, pipeline_1f1b
from zoo.layers.stage import LossHead, Rows, Stack

M, T, b = 8, 4, 2  # width, tokens per row, rows per micro-batch and data shard


def _layer(w, x, rows, c):
    h = jnp.tanh(x @ w["a"] + w["b"] + c)
    # 0 for real rows, NaN on a bubble's zeros (forward and gradient).
    poison = 0.0 * jnp.log(jnp.mean(x * x, axis=-1, keepdims=True))
    return x + h * (rows.ids[..., None] > 0) + poison


def _loss(params, y, rows):
    err = jnp.sum(y * params["v"], axis=-1) - rows.targets
    return jnp.sum(jnp.where(rows.mask, err * err, 0.0)).astype(jnp.float32)


def _toy(S: int, L: int, check_vma: bool = True):
    mesh = jax.make_mesh(
        (2, S) if 2 * S <= 8 else (1, S),
        ("data", "stage"),
        axis_types=(AxisType.Explicit,) * 2,
        devices=jax.devices()[: (2 if 2 * S <= 8 else 1) * S],
    )
    rng = np.random.default_rng(S * 100 + L)
    weights = {
        "a": (rng.normal(size=(L, M, M)) / np.sqrt(M)).astype(np.float32),
        "b": rng.normal(size=(L, M)).astype(np.float32) * 0.1,
    }
    consts = (np.arange(L, dtype=np.float32) * 0.05)[:, None]
    stack = Stack(
        layer=_layer,
        cast=lambda w: w,
        weights=weights,
        consts=consts,
        policy=None,
        check_vma=check_vma,
    )
    head = LossHead(params={"v": rng.normal(size=(M,)).astype(np.float32)}, loss=_loss)
    return mesh, stack, head


def _rows(mesh, mb: int, rng_seed: int):
    D = mesh.shape["data"]
    B = mb * D * b
    rng = np.random.default_rng(rng_seed)
    x = rng.normal(size=(B, T, M)).astype(np.float32)
    ids = np.ones((B, T), np.int32)
    ids[::3, -1] = 0  # some padding: the layer and the loss read the rows
    rows = Rows(
        ids=ids,
        positions=np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)).copy(),
        targets=rng.normal(size=(B, T)).astype(np.float32),
        mask=ids > 0,
    )
    return x, rows


def _sequential(stack: Stack, head: LossHead, weights, params, x, rows):
    L = jax.tree.leaves(weights)[0].shape[0]
    for layer in range(L):
        w = jax.tree.map(lambda a, i=layer: a[i], weights)
        x = stack.layer(stack.cast(w), x, rows, stack.consts[layer])
    return x, head.loss(params, x, rows)


def _place(mesh, tree, spec):
    return jax.tree.map(lambda a: jax.device_put(a, jax.NamedSharding(mesh, spec)), tree)


CASES = [
    # (schedule, stages, micro-batches, repeats)
    ("gpipe", 2, 2, 1),
    ("gpipe", 3, 6, 1),
    ("gpipe", 4, 4, 1),
    ("circular", 2, 2, 2),  # Mb = S: each result goes round at once
    ("circular", 3, 6, 2),  # the loop-back buffer holds a result S-1 iterations
    ("circular", 4, 8, 2),
    ("1f1b", 2, 6, 1),  # ring of 3 slots, wraps twice
    ("1f1b", 3, 3, 1),
    ("1f1b", 4, 8, 1),  # ring of 7 slots, wraps once
]


@pytest.mark.parametrize(
    "schedule, S, mb, R", CASES, ids=[f"{c[0]}-S{c[1]}-mb{c[2]}" for c in CASES]
)
def test_schedule_equals_the_sequential_stack(schedule, S, mb, R):
    L = S * R * 2  # two layers per chunk
    mesh, stack, head = _toy(S, L)
    pp = pipeline.plan(L, S, mb, R, schedule)
    x_np, rows_np = _rows(mesh, mb, rng_seed=S + mb)

    def sequential(weights, params, x):
        return _sequential(stack, head, weights, params, x, rows_np)

    (want_y, want_loss), want_grads = jax.jit(
        lambda w, p, x: (
            sequential(w, p, x),
            jax.grad(lambda *a: sequential(*a)[1], (0, 1, 2))(w, p, x),
        )
    )(stack.weights, head.params, x_np)

    with jax.set_mesh(mesh):
        rows_spec = P(("data", "stage"))
        weights = _place(mesh, stack.weights, P("stage"))
        params = _place(mesh, head.params, P())
        x = _place(mesh, x_np, rows_spec)
        rows = _place(mesh, rows_np, rows_spec)

        def forward(weights, x):
            y, stats = pipeline.run_stack(stack._replace(weights=weights), pp, "stage", x, rows)
            assert stats is None  # the layer returns none
            return y

        def loss(weights, params, x):
            if schedule == "1f1b":
                return pipeline_1f1b.nll_sum(
                    stack._replace(weights=weights),
                    head._replace(params=params),
                    pp,
                    "stage",
                    x,
                    rows,
                )[0]
            y = forward(weights, x)
            return _sequential_loss_on(head, params, y, rows)

        y = jax.jit(forward)(weights, x)
        got_loss, got_grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2)))(weights, params, x)

    np.testing.assert_allclose(np.asarray(y), np.asarray(want_y), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=2e-5)
    for got, want in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        assert np.all(np.isfinite(np.asarray(got)))
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=2e-5)


def _sequential_loss_on(head, params, y, rows):
    return head.loss(params, y, rows)


def test_1f1b_forward_without_gradient_equals_the_sequential_loss():
    # Evaluation: the custom VJP's primal (GPipe's forward, the loss on each stage's rows).
    S, mb, L = 2, 4, 4
    mesh, stack, head = _toy(S, L)
    pp = pipeline.plan(L, S, mb, 1, "1f1b")
    x_np, rows_np = _rows(mesh, mb, rng_seed=7)
    _, want = _sequential(stack, head, stack.weights, head.params, x_np, rows_np)
    with jax.set_mesh(mesh):
        rows_spec = P(("data", "stage"))
        got = jax.jit(
            lambda w, p, x, r: pipeline_1f1b.nll_sum(
                stack._replace(weights=w), head._replace(params=p), pp, "stage", x, r
            )[0]
        )(
            _place(mesh, stack.weights, P("stage")),
            _place(mesh, head.params, P()),
            _place(mesh, x_np, rows_spec),
            _place(mesh, rows_np, rows_spec),
        )
    np.testing.assert_allclose(float(got), float(want), rtol=2e-5)


def test_1f1b_keeps_no_weights_among_its_residuals():
    # The weight slice of a layer's pullback is read from its jaxpr, and left out of the ring.
    w = {"a": jnp.ones((M, M)), "b": jnp.ones((M,))}
    x = jnp.ones((b, T, M))
    rows = Rows(jnp.ones((b, T), jnp.int32), jnp.zeros((b, T), jnp.int32))

    def layer_vjp(w_leaves, x):
        w = jax.tree.unflatten(jax.tree.structure({"a": 0, "b": 0}), w_leaves)
        return jax.vjp(lambda w, x: _layer(w, x, rows, 0.0), w, x)

    layout = pipeline_1f1b.residual_layout(layer_vjp, jax.tree.leaves(w), x)
    # "a" (leaf 0) is a residual (dx needs it), kept out; "b" (a bias) is no residual at all.
    assert [i for i in layout.weight_of if i is not None] == [0]
    _, pullback = layer_vjp(jax.tree.leaves(w), x)
    kept = layout.keep(pullback)
    assert all(a.shape != (M, M) for a in kept)


@pytest.mark.parametrize("mb", [3, 5])
def test_micro_batches_not_a_multiple_of_the_stages_are_one_line(mb):
    with pytest.raises(UsageError, match=f"pipeline_microbatches={mb} is") as raised:
        pipeline.plan(8, 2 if mb == 3 else 4, mb, 1, "gpipe")
    assert "\n" not in str(raised.value)


def _layer_with_stats(w, x, rows, c):
    """The toy layer, also returning a per-layer sum over its real rows (as an MoE layer
    returns its routing counts): the schedules add them up over micro-batches."""
    y = _layer(w, x, rows, c)
    real = (rows.ids > 0).astype(jnp.float32)
    return y, {"sq": jnp.sum(jnp.mean(y * y, axis=-1) * real), "rows": jnp.sum(real)}


STATS_CASES = [("gpipe", 2, 4, 1), ("circular", 3, 6, 2), ("1f1b", 3, 6, 1)]


@pytest.mark.parametrize(
    "schedule, S, mb, R", STATS_CASES, ids=[f"{c[0]}-S{c[1]}" for c in STATS_CASES]
)
def test_layer_statistics_sum_over_microbatches_in_layer_order(schedule, S, mb, R):
    """Each layer's statistics come back as the whole batch's sum, in layer order (the
    circular schedule runs chunks out of storage order), bubbles excluded (their NaNs would
    show)."""
    L = S * R * 2
    mesh, stack, head = _toy(S, L)
    zero = {"sq": jnp.zeros((), jnp.float32), "rows": jnp.zeros((), jnp.float32)}
    stack = stack._replace(layer=_layer_with_stats, stats=zero, check_vma=False)
    pp = pipeline.plan(L, S, mb, R, schedule)
    x_np, rows_np = _rows(mesh, mb, rng_seed=11)
    want, x = [], x_np
    for layer in range(L):
        w = jax.tree.map(lambda a, i=layer: a[i], stack.weights)
        x, stats = stack.layer(w, x, rows_np, stack.consts[layer])
        want.append(stats)
    with jax.set_mesh(mesh):
        rows_spec = P(("data", "stage"))
        args = (
            _place(mesh, stack.weights, P("stage")),
            _place(mesh, head.params, P()),
            _place(mesh, x_np, rows_spec),
            _place(mesh, rows_np, rows_spec),
        )
        if schedule == "1f1b":

            def run(w, p, x, r):
                (_, stats), _ = jax.value_and_grad(
                    lambda w: pipeline_1f1b.nll_sum(
                        stack._replace(weights=w), head._replace(params=p), pp, "stage", x, r
                    ),
                    has_aux=True,
                )(w)
                return stats

        else:

            def run(w, p, x, r):
                return pipeline.run_stack(stack._replace(weights=w), pp, "stage", x, r)[1]

        got = jax.jit(run)(*args)
    for key in ("sq", "rows"):
        np.testing.assert_allclose(
            np.asarray(got[key]), np.array([float(w[key]) for w in want]), rtol=2e-5
        )
