"""The 1F1B schedule (`pipeline_schedule=1f1b`, zoo/layers/pipeline_1f1b.py) passes the checks
every strategy passes (test_strategies_equal_one_device.py's tests, run here on these cases):
declared layouts are the live ones, and the loss, every gradient and ten AdamW steps equal the
one-device run, in float32 on packed rows, on 2 and 4 stages with 4 and 8 micro-batches (more
than the 2S-1 slots of its ring of residuals), under both pipeline strategies and two remat
policies (the third, `full`, trains through train_main in test_pipeline_1f1b_train.py). The loss
and gradients are the trainer's (`training.loop.train_loss_sum` given the plan's schedule, which
1F1B computes inside its loop); the logits come from the forward (GPipe's loop,
`zoo.pipelined`). Tolerances are that file's (its docstring gives the reasons): the pipeline
only reorders which rows run when, and sums the micro-batches' gradients in another order.

Memory: compiled for CPU devices with the rows per micro-batch fixed, 1F1B's temporaries do not
grow with the micro-batch count beyond the rows themselves (the embedded inputs, their
gradient), while GPipe keeps every micro-batch's saved activations. And the schedule's name is
checked against pipeline_repeats in one line.
"""

from __future__ import annotations

import dataclasses

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

from nnx_zoo.planning.chips import chip_for
from nnx_zoo.planning.compile import Candidate, Target, compile_plan
from nnx_zoo.training.config import RunConfig
from nnx_zoo.training.loop import train_loss_sum
from shardings import get_strategy
from zoo import get_config, pipelined
from zoo.layers import pipeline

BASE = get_config("tiny").replace(num_layers=4, pipeline_schedule="1f1b")
# (strategy, mesh, micro-batches, remat); batch 8 rows (equal._run's).
# remat 'full' runs through train_main (test_pipeline_1f1b_train.py).
CASES = [
    ("fsdp_pp", (4, 2), 4, "none"),  # 4 stages, Mb = S: the ring (7 slots) never wraps
    ("fsdp_tp_pp", (2, 1, 4), 8, "dots"),  # 2 stages, tp inside, 8 micro-batches, 3 slots
]


def _trainer_objective(model, batch):
    """(loss, logits, grads, extras) as equal._run compares them: the trainer's token-mean
    loss and its gradients (1F1B's loop), the logits of the model's forward."""

    pp = pipeline.plan_for(model.cfg, model.sharding, jax.sharding.get_abstract_mesh())
    assert pp.schedule == "1f1b"

    def mean_loss(model):
        total, (count, _) = train_loss_sum(model, batch, pipeline=pp)
        return total / count

    loss, grads = nnx.value_and_grad(mean_loss)(model)
    logits = pipelined.logits(
        model, pp, batch["tokens"], segment_ids=batch["segment_ids"], positions=batch["positions"]
    )
    return loss, logits, grads, {}


@pytest.fixture(scope="module")
def reference():
    """The one-device run (no pipeline: the schedule field is ignored without a stage axis)."""
    return equal._run("dp", one_device_mesh(), cfg=BASE)


@pytest.fixture(
    scope="module",
    params=CASES,
    ids=[f"{s}-{'x'.join(map(str, m))}-mb{mb}-{rm}" for s, m, mb, rm in CASES],
)
def sharded(request, reference, monkeypatch_module):
    name, shape, microbatches, remat = request.param
    cfg = BASE.replace(pipeline_microbatches=microbatches, remat=remat)
    monkeypatch_module.setattr(equal, "CFG", cfg)  # the shared layout test reads it
    mesh = get_strategy(name).make_mesh(shape=shape)
    run = equal._run(
        name, mesh, init_params=reference["params"], cfg=cfg, objective=_trainer_objective
    )
    return name, run


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_the_case_ran_1f1b():
    # Guards the cases above against a config that silently fell back to GPipe.
    plan = pipeline.plan(BASE.num_layers, 2, 8, BASE.pipeline_repeats, BASE.pipeline_schedule)
    assert plan.schedule == "1f1b" and plan.in_flight == 3 and plan.loop_iterations == 10


# -- the schedule's name ------------------------------------------------------------------


@pytest.mark.parametrize(
    "schedule, repeats, expected",
    [
        ("auto", 1, "gpipe"),
        ("auto", 2, "circular"),
        ("gpipe", 1, "gpipe"),
        ("circular", 3, "circular"),
        ("1f1b", 1, "1f1b"),
    ],
)
def test_schedule_resolves_from_its_name_and_repeats(schedule, repeats, expected):
    assert pipeline.plan(12, 2, 4, repeats, schedule).schedule == expected


@pytest.mark.parametrize(
    "schedule, repeats, message",
    [
        ("zb", 1, "pipeline_schedule='zb'; valid: auto, gpipe, circular, 1f1b"),
        ("1f1b", 2, "set pipeline_repeats=1, or use pipeline_schedule=circular"),
        ("gpipe", 2, "set pipeline_repeats=1, or use pipeline_schedule=circular"),
        ("circular", 1, "needs pipeline_repeats >= 2"),
    ],
)
def test_a_schedule_that_cannot_run_is_one_line(schedule, repeats, message):
    model = {"preset": "tiny", "pipeline_schedule": schedule, "pipeline_repeats": repeats}
    with pytest.raises(ValueError, match="config model.pipeline_schedule") as raised:
        RunConfig.from_config_dict({"model": model})
    assert message in str(raised.value) and "\n" not in str(raised.value)
    with pytest.raises(ValueError, match="pipeline_schedule"):
        get_config("tiny").replace(pipeline_schedule=schedule, pipeline_repeats=repeats)


def test_offloading_remat_under_1f1b_is_one_line():
    with pytest.raises(ValueError, match="remat='offload' under pipeline_schedule='1f1b'"):
        get_config("tiny").replace(pipeline_schedule="1f1b", remat="offload")


# -- memory ------------------------------------------------------------------------------

# Rows fixed per micro-batch (one per data shard), so a step with more micro-batches has a
# larger batch: GPipe's temporaries grow by every added micro-batch's saved activations (remat
# 'none': every layer's, attention scores included), 1F1B's only by the rows' own embedded
# inputs and their gradient. 2 stages of 2 layers, data 4.
MEMORY_RUN = RunConfig.from_config_dict(
    {
        "model": {"preset": "tiny", "num_layers": 4, "remat": "none", "hidden_dim": 64},
        "data": {"seq_len": 128, "global_batch_size": 16},
    }
)


def _temp_bytes(schedule: str, microbatches: int) -> int:
    model = dataclasses.replace(
        MEMORY_RUN.model, pipeline_schedule=schedule, pipeline_microbatches=microbatches
    )
    data = dataclasses.replace(MEMORY_RUN.data, global_batch_size=4 * microbatches)
    run = dataclasses.replace(MEMORY_RUN, model=model, data=data)
    target = Target("cpu:8", tuple(jax.devices()), chip_for("cpu", memory_gib=16))
    return compile_plan(run, Candidate("fsdp_pp", (2, 4), "none", 1), target).temp_bytes


def test_1f1b_temporaries_do_not_grow_with_micro_batches():
    one_f_one_b = {mb: _temp_bytes("1f1b", mb) for mb in (4, 8)}
    gpipe = _temp_bytes("gpipe", 8)
    # One micro-batch's saved activations, as GPipe's and 1F1B's temporaries differ at
    # Mb = 8 by Mb + S-1 - (2S-1) = 6 of them (the rest of the step is the same).
    per_microbatch = (gpipe - one_f_one_b[8]) / 6
    grown = one_f_one_b[8] - one_f_one_b[4]
    # Four more micro-batches cost 1F1B less than one micro-batch's activations: what grows
    # is the rows' inputs and gradient, [Mb, b, T, M] each, not the ring of 2S-1 slots.
    rows_bytes = 4 * 128 * 64 * 4  # four more micro-batches of b = 1 row, T = 128, M = 64
    assert per_microbatch > 20 * rows_bytes, (per_microbatch, rows_bytes)
    assert grown < per_microbatch, (one_f_one_b, gpipe)
    assert grown <= 8 * rows_bytes, (one_f_one_b, rows_bytes)


def test_lora_under_1f1b_is_one_line():
    from zoo import create_model
    from zoo.layers.lora import LoraConfig, add_lora

    strategy = get_strategy("fsdp_pp")
    cfg = get_config("tiny").replace(pipeline_schedule="1f1b")
    with jax.set_mesh(strategy.make_mesh(shape=(2, 4))):
        model = nnx.eval_shape(lambda: create_model(cfg, strategy, rngs=nnx.Rngs(0)))
        with pytest.raises(ValueError, match="do not train under pipeline_schedule=1f1b"):
            add_lora(model, LoraConfig(rank=4, alpha=8.0), nnx.Rngs(0))
