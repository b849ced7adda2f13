"""The pipeline strategies pass the same checks as every other strategy
(test_strategies_equal_one_device.py, whose tests run here on these cases): declared layouts
are the live ones, and logits, loss, gradients and ten AdamW steps equal the one-device run,
in float32 on packed rows, for both schedules (GPipe: repeats 1; circular: repeats 2) on 2 and
4 stages under both strategies, with as many micro-batches as stages and with more (the
loop-back buffer's delay).

The model has 4 layers, so that 2 stages x 2 repeats and 4 stages divide it; the circular
case on 4 stages has 8 (2 repeats x 4 stages, one layer per chunk) and its own one-device
reference. Two cases remat (the pipeline checkpoints each layer under the model's policy).
Tolerances are that file's (its docstring gives the reasons): a pipeline only reorders which
rows run when, so the sums inside a row are the one-device run's.
"""

from __future__ import annotations

import jax
import pytest
import test_strategies_equal_one_device as equal
from flax import nnx
from model_utils import one_device_mesh
from test_strategies_equal_one_device import (  # noqa: F401 -- collected here, on this module's fixtures
    test_adamw_steps_equal_one_device,
    test_logits_loss_grads_equal_one_device,
    test_module_outputs_have_declared_layouts,
    test_parameter_layouts_are_declared,
    test_strategy_actually_shards,
)

from shardings import get_strategy
from zoo import get_config, pipelined
from zoo.layers import pipeline
from zoo.loss import lm_loss

BASE = get_config("tiny").replace(num_layers=4)
# (strategy, mesh, micro-batches, repeats, layers, remat)
CASES = [
    ("fsdp_pp", (2, 4), 2, 1, 4, "none"),  # GPipe, 2 stages
    ("fsdp_pp", (4, 2), 4, 1, 4, "none"),  # GPipe, 4 stages
    ("fsdp_pp", (2, 4), 2, 2, 4, "none"),  # circular, layer chunk c on stage c mod 2
    # Circular, more micro-batches than stages, with tp.
    ("fsdp_tp_pp", (2, 2, 2), 4, 2, 4, "dots"),
    # GPipe on 4 stages with tp inside each: with the case above, fsdp_tp_pp runs both
    # schedules and both stage counts (fsdp inside a stage under GPipe is fsdp_pp's cases').
    ("fsdp_tp_pp", (4, 1, 2), 4, 1, 4, "none"),
    ("fsdp_pp", (4, 2), 4, 2, 8, "full"),  # circular on 4 stages
]


def _pipelined_objective(model, batch):
    """(loss, logits, grads, extras) as equal._run compares them, the layer stack run by the
    schedule the model's plan gives (zoo.pipelined; the model alone would run its own loop)."""
    pp = pipeline.plan_for(model.cfg, model.sharding, jax.sharding.get_abstract_mesh())
    assert pp is not None

    def loss_fn(model):
        logits = pipelined.logits(
            model,
            pp,
            batch["tokens"],
            segment_ids=batch["segment_ids"],
            positions=batch["positions"],
        )
        return lm_loss(logits, batch["tokens"], batch["segment_ids"])[0], logits

    (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    return loss, logits, grads, {}


@pytest.fixture(scope="module")
def references():
    """The one-device run per layer count, each made once."""
    runs = {}

    def get(num_layers):
        if num_layers not in runs:
            runs[num_layers] = equal._run(
                "dp", one_device_mesh(), cfg=BASE.replace(num_layers=num_layers)
            )
        return runs[num_layers]

    return get


@pytest.fixture(
    scope="module",
    params=CASES,
    ids=[f"{s}-{'x'.join(map(str, m))}-mb{mb}-r{r}-l{n}-{rm}" for s, m, mb, r, n, rm in CASES],
)
def case(request):
    return request.param


@pytest.fixture(scope="module")
def reference(case, references):
    return references(case[4])


@pytest.fixture(scope="module")
def sharded(case, reference, monkeypatch_module):
    name, shape, microbatches, repeats, num_layers, remat = case
    cfg = BASE.replace(
        num_layers=num_layers,
        pipeline_microbatches=microbatches,
        pipeline_repeats=repeats,
        remat=remat,
    )
    # The shared layout test reads the module's config.
    monkeypatch_module.setattr(equal, "CFG", cfg)
    mesh = get_strategy(name).make_mesh(shape=shape)
    run = equal._run(
        name, mesh, init_params=reference["params"], cfg=cfg, objective=_pipelined_objective
    )
    return name, run


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_weights_split_over_stage(sharded):
    name, run = sharded
    for path, spec in run["live_layouts"].items():
        assert (spec[0] == "stage") == path.startswith("blocks/"), f"{name}: {path} is {spec}"
