"""The layout fix for black-box attention backends, through an fsdp_tp train step: with it
the step compiles, the numbers equal the xla run and the attention output has its declared
layout; without it the same step raises.

No GPU here, so a stand-in plays cuDNN: jax's cuDNN primitive (jax 0.10.2,
`_attention_out_aval` in jax/_src/cudnn/fused_attention_stablehlo.py) types its output
*and* the q/k/v gradients of its custom_vjp unsharded outside shard_map, and carries the
varying manual axes inside it. The stand-in does the same around the xla numbers: a
custom_vjp whose forward output and backward gradients are typed unsharded (`P()`) under
explicit axes, and honest inside shard_map, where there are none.

Tolerance: the stand-in computes the same per-device attention as the xla path, so loss
and gradients equal the xla run to float32 rounding of a different reduction order after
shard_map (2e-5 absolute on O(1) losses, 1e-5 + 1e-4 relative on gradients).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from model_utils import packed_batch, put_batch

from nnx_zoo.runtime import compat
from shardings import get_strategy
from shardings.specs import normalize
from zoo import create_model, get_config
from zoo.layers.attention import dispatch as attention_ops
from zoo.layers.attention import registry
from zoo.loss import lm_loss

STRATEGY = "fsdp_tp"
MESH_SHAPE = (4, 2)


def _untyped(x):
    """x with its layout dropped from its type, as the cuDNN primitive's avals do."""
    if jax.sharding.get_abstract_mesh().explicit_axes:
        return jax.sharding.reshard(x, P())
    return x


def cudnn_like(q_BTND, k_BSKD, v_BSKD, segments, *, sliding_window, out_sharding, **static):
    """xla's numbers behind a custom_vjp whose output and q/k/v gradients are untyped."""
    del out_sharding  # a black box does not take a layout
    xla = registry._BACKENDS["xla"].fn
    static_window = sliding_window is None or isinstance(sliding_window, int)
    window = jax.numpy.int32(0) if static_window else sliding_window
    out_spec = []  # the layout the xla numbers come in, for the incoming cotangent

    def compute(q, k, v, segs, w):
        return xla(
            q,
            k,
            v,
            segs,
            sliding_window=sliding_window if static_window else w,
            out_sharding=None,
            **static,
        )

    @jax.custom_vjp
    def call(q, k, v, segs, w):
        return _untyped(compute(q, k, v, segs, w))

    def fwd(q, k, v, segs, w):
        out, vjp = jax.vjp(lambda q, k, v: compute(q, k, v, segs, w), q, k, v)
        out_spec.append(jax.typeof(out).sharding.spec)
        return _untyped(out), vjp

    def bwd(vjp, g):
        if jax.sharding.get_abstract_mesh().explicit_axes:
            g = jax.sharding.reshard(g, out_spec[0])
        return (*(_untyped(d) for d in vjp(g)), None, None)

    call.defvjp(fwd, bwd)
    return call(q_BTND, k_BSKD, v_BSKD, segments, window)


def cudnn_like_resharded(*args, out_sharding, **kwargs):
    """The other fix on offer: reshard the output after the call. It reaches the forward
    output but not the gradients the custom_vjp hands back."""
    return jax.sharding.reshard(cudnn_like(*args, out_sharding=None, **kwargs), out_sharding)


def _train_step(model, batch):
    def loss_fn(model):
        logits = model(
            batch["tokens"], segment_ids=batch["segment_ids"], positions=batch["positions"]
        )
        return lm_loss(logits, batch["tokens"], batch["segment_ids"])[0]

    return nnx.value_and_grad(loss_fn)(model)


@pytest.fixture(scope="module")
def setup():
    assert len(jax.devices()) == 8, "tests/conftest.py must force 8 CPU devices before jax"
    strategy = get_strategy(STRATEGY)
    mesh = strategy.make_mesh(shape=MESH_SHAPE)
    batch = packed_batch(batch=8, seq=32, vocab=get_config("tiny").vocab_size)
    return strategy, mesh, batch


def _step(setup, attention_impl, monkeypatch=None):
    """(loss, grads as host arrays, [(declared, live) attention output specs])."""
    strategy, mesh, batch_np = setup
    cfg = get_config("tiny", attention_impl=attention_impl)
    records = []
    if monkeypatch is not None:
        inner = attention_ops.attention

        def recording(*args, **kwargs):
            out = inner(*args, **kwargs)
            records.append((normalize(kwargs["out_sharding"], 4), _live(out)))
            return out

        # The model calls `attention_ops.attention` by attribute, so this sees every layer
        # (traced inside the layer scan, where arrays still carry their sharding type).
        monkeypatch.setattr(attention_ops, "attention", recording)
    with jax.set_mesh(mesh):
        model = create_model(cfg, strategy, rngs=nnx.Rngs(0))
        batch = put_batch(batch_np, strategy.batch_spec())
        loss, grads = nnx.jit(_train_step)(model, batch)
        flat = nnx.to_flat_state(nnx.state(grads, nnx.Param))
        grads = {"/".join(map(str, p)): np.asarray(v[...]) for p, v in flat}
    return float(loss), grads, records


def _live(x):
    return normalize(jax.typeof(x).sharding.spec, x.ndim)


@pytest.fixture(scope="module")
def xla_run(setup):
    return _step(setup, "xla")


def test_with_the_fix_the_step_compiles_keeps_layouts_and_equals_xla(setup, xla_run, monkeypatch):
    with registry.override_backend("cudnn", cudnn_like, keeps_layout=False):
        loss, grads, records = _step(setup, "cudnn", monkeypatch)
    declared = normalize(get_strategy(STRATEGY).lm_sharding().block.attention.q.out, 4)
    assert declared == P("data", None, "model", None)
    assert records and all(r == (declared, declared) for r in records), records
    xla_loss, xla_grads, _ = xla_run
    np.testing.assert_allclose(loss, xla_loss, atol=2e-5, rtol=0)
    assert grads.keys() == xla_grads.keys()
    for name, g in grads.items():
        np.testing.assert_allclose(g, xla_grads[name], atol=1e-5, rtol=1e-4, err_msg=name)


@pytest.mark.parametrize(
    "backend", [cudnn_like, cudnn_like_resharded], ids=["trusted", "reshard_after"]
)
def test_without_the_fix_the_same_step_raises(setup, backend):
    """keeps_layout=True: the dispatcher trusts the black box and calls it as is. Neither the
    bare call nor a reshard of its output gets through the backward pass."""
    with (
        registry.override_backend("cudnn", backend, keeps_layout=True),
        # jax reworded this error between the ends of pyproject's range (nnx_zoo/runtime/compat.py).
        pytest.raises(ValueError, match=compat.CUSTOM_VJP_TYPE_MISMATCH),
    ):
        _step(setup, "cudnn")


def test_without_the_fix_the_forward_output_loses_its_layout(setup, monkeypatch):
    """Forward only, the bare call does not raise in this model (its out-projection names
    its output layout, so XLA gathers the untyped operand), but the attention output is
    typed unsharded: each device would hold, and the compiler move, all of it."""
    strategy, mesh, batch_np = setup
    cfg = get_config("tiny", attention_impl="cudnn")
    records = []
    inner = attention_ops.attention

    def recording(*args, **kwargs):
        out = inner(*args, **kwargs)
        records.append(_live(out))
        return out

    monkeypatch.setattr(attention_ops, "attention", recording)
    with (
        registry.override_backend("cudnn", cudnn_like, keeps_layout=True),
        jax.set_mesh(mesh),
    ):
        model = create_model(cfg, strategy, rngs=nnx.Rngs(0))
        batch = put_batch(batch_np, strategy.batch_spec())
        nnx.jit(
            lambda m, b: m(b["tokens"], segment_ids=b["segment_ids"], positions=b["positions"])
        )(model, batch)
    assert records and all(r == P(None, None, None, None) for r in records), records
