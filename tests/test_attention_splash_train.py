"""An fsdp_tp (4, 2) train step of the tiny model with the splash backend (interpret mode)
equals the xla backend's loss and gradients, and every layout is the declared one.

The loss is the product's (`training.loop.loss_sum`, differentiated as the Trainer does).
Splash runs per device inside shard_map over `data` (batch) and `model` (heads); the test
records the attention output's live layout in every layer and each gradient's layout.

Tolerance: the two backends compute the same float32 attention in a different order (online
softmax over 128-key blocks against one softmax), a few ulps per attention output; through
four layers and the sums over 8 x 128 tokens that make a parameter gradient this stays below
1e-5 absolute on the O(1) loss and 2e-5 + 1e-3 relative on gradients.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from model_utils import packed_batch, put_batch

from nnx_zoo.training.loop import loss_sum
from shardings import get_strategy
from shardings.specs import normalize
from zoo import create_model, get_config
from zoo.layers.attention import dispatch as attention_ops

STRATEGY = "fsdp_tp"
MESH_SHAPE = (4, 2)
T = 128  # splash tiles keys in multiples of 128


@pytest.fixture(scope="module")
def setup():
    assert len(jax.devices()) == 8, "tests/conftest.py must force 8 CPU devices before jax"
    strategy = get_strategy(STRATEGY)
    mesh = strategy.make_mesh(shape=MESH_SHAPE)
    batch = packed_batch(batch=8, seq=T, vocab=get_config("tiny").vocab_size)
    return strategy, mesh, batch


def _step(setup, attention_impl):
    """(loss, {path: (grad on host, live spec, declared spec)}, [(declared, live)])."""
    strategy, mesh, batch_np = setup
    cfg = get_config("tiny", attention_impl=attention_impl, attention_interpret=True)
    records = []
    inner = attention_ops.attention

    def recording(*args, **kwargs):
        out = inner(*args, **kwargs)
        records.append((normalize(kwargs["out_sharding"], 4), normalize(out.aval.sharding.spec, 4)))
        return out

    def loss_and_grad(model, batch):
        grad_fn = nnx.value_and_grad(loss_sum, has_aux=True)
        (nll, count), grads = grad_fn(model, batch)
        return nll / count, grads

    mp = pytest.MonkeyPatch()
    # The model calls `attention_ops.attention` by attribute, so this sees every layer.
    mp.setattr(attention_ops, "attention", recording)
    try:
        with jax.set_mesh(mesh):
            model = create_model(cfg, strategy, rngs=nnx.Rngs(0))
            declared = {
                "/".join(map(str, p)): normalize(v.get_metadata()["out_sharding"], v[...].ndim)
                for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
            }
            batch = put_batch(batch_np, strategy.batch_spec())
            loss, grads = nnx.jit(loss_and_grad)(model, batch)
            grads = {
                "/".join(map(str, p)): (
                    np.asarray(v[...]),
                    normalize(v[...].sharding.spec, v[...].ndim),
                )
                for p, v in nnx.to_flat_state(nnx.state(grads, nnx.Param))
            }
    finally:
        mp.undo()
    return float(loss), grads, declared, records


@pytest.fixture(scope="module")
def xla_run(setup):
    return _step(setup, "xla")


@pytest.fixture(scope="module")
def splash_run(setup):
    return _step(setup, "splash")


def test_splash_train_step_equals_xla(xla_run, splash_run):
    loss, grads, _, _ = splash_run
    xla_loss, xla_grads, _, _ = xla_run
    assert np.isfinite(loss) and loss > 1.0  # an untrained model over 512 ids: about 6.2
    np.testing.assert_allclose(loss, xla_loss, atol=1e-5, rtol=0)
    assert grads.keys() == xla_grads.keys()
    for name, (g, _) in grads.items():
        assert np.abs(xla_grads[name][0]).max() > 0, f"{name}: zero gradient, weak test"
        np.testing.assert_allclose(g, xla_grads[name][0], atol=2e-5, rtol=1e-3, err_msg=name)


def test_splash_train_step_keeps_every_declared_layout(splash_run):
    _, grads, declared, records = splash_run
    want = normalize(get_strategy(STRATEGY).lm_sharding().block.attention.q.out, 4)
    assert want == jax.sharding.PartitionSpec("data", None, "model", None)
    assert records and all(r == (want, want) for r in records), records
    for name, (_, live) in grads.items():
        assert live == declared[name], f"{name}: gradient {live}, parameter {declared[name]}"
