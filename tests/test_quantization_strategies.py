"""The quantized tiny model under each strategy equals the quantized one-device model: loss
and gradients of one packed batch.

Tolerance reasoning (float32 compute): the scales are global (each tensor's amax is a max,
all-reduced exactly), so the sharded run quantizes the same values as one device except
where float32 summation order already differs (~1e-6 relative, as in
test_strategies_equal_one_device). Such a value lying on a rounding boundary of the grid may
round to the neighbouring grid point: one element moves by one step of its format (2^-3 of it
in e4m3, 2^-2 in e5m2, 1/127 of its row's amax in int8). Rare, and diluted in sums, so the loss
agrees to 1e-5 and each gradient tensor to 1% of its largest entry (rather than 1e-5 + 1e-4
relative without quantization); a layout bug (a wrong scale, a transposed or unreduced
gradient) is off by the gradient's own size.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from model_utils import host_params, load_params, one_device_mesh, packed_batch, put_batch

from shardings import get_strategy
from zoo import create_model, get_config
from zoo.loss import lm_loss

CASES = [("dp", (8,)), ("fsdp", (8,)), ("tp", (4, 2)), ("fsdp_tp", (4, 2)), ("fsdp_cp", (4, 2))]


def _run(cfg, strategy_name, mesh, init_params=None):
    strategy = get_strategy(strategy_name)
    batch_np = packed_batch(batch=8, seq=32, vocab=cfg.vocab_size)
    with jax.set_mesh(mesh):
        model = create_model(cfg, strategy, rngs=nnx.Rngs(0))
        if init_params is not None:
            load_params(model, init_params)
        batch = put_batch(batch_np, strategy.batch_spec())

        @nnx.jit
        def loss_and_grads(model, batch):
            def loss_fn(model):
                logits = model(
                    batch["tokens"], segment_ids=batch["segment_ids"], positions=batch["positions"]
                )
                return lm_loss(logits, batch["tokens"], batch["segment_ids"])[0]

            return nnx.value_and_grad(loss_fn)(model)

        params = host_params(model)
        loss, grads = loss_and_grads(model, batch)
        flat = nnx.to_flat_state(nnx.state(grads, nnx.Param))
        return params, float(loss), {"/".join(map(str, p)): np.asarray(v[...]) for p, v in flat}


@pytest.fixture(scope="module", params=["fp8", "int8"])
def reference(request):
    cfg = get_config("tiny", quantization=request.param)
    return cfg, _run(cfg, "dp", one_device_mesh())


@pytest.mark.parametrize("case", CASES, ids=[f"{s}-{'x'.join(map(str, m))}" for s, m in CASES])
def test_quantized_strategy_equals_one_device(case, reference):
    cfg, (params, ref_loss, ref_grads) = reference
    name, shape = case
    _, loss, grads = _run(cfg, name, get_strategy(name).make_mesh(shape=shape), params)
    assert abs(loss - ref_loss) < 1e-5, (loss, ref_loss)
    for path, g in ref_grads.items():
        scale = float(np.abs(g).max())
        np.testing.assert_allclose(grads[path], g, atol=1e-2 * scale, rtol=0, err_msg=path)
