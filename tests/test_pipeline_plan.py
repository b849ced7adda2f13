"""The planner knows the pipeline: compiled for two hosts of 8 H100s with one stage per host,
the step's HLO moves activations between the stages with collective-permutes over `stage`,
and the reported bubble is the schedule's, (S-1)/(Mb*R + S-1); the step-time model charges
it (the layers' FLOPs scaled by iterations / useful iterations).

Issue 28, check 3: compiled for h100:2x8 and v5p:4x4x4, under both pipeline strategies,
nothing crosses `stage` but collective-permutes and what data parallelism over `stage`
needs anyway, which is inherent: the gradient reduction of the weights replicated over
`stage` (embeddings, norms, LM head) and the loss's sums, once per step. So a collective
over `stage` that is not a permute must be an all-reduce / reduce-scatter whose bytes per
step stay within those weights' float32 shards (an activation gathered or summed over
`stage`, or a reduction inside the pipeline's loop, exceeds that).
"""

from __future__ import annotations

import jax
import pytest

from planning.chips import chip_for
from planning.cli import _strategies
from planning.compile import Candidate, Target, compile_plan, make_target, run_for
from planning.estimate import estimate_step
from planning.search import candidate_space, pipeline_microbatches, search
from shardings import get_strategy
from shardings.specs import split_size
from training.config import RunConfig
from zoo import get_config, param_layouts
from zoo.layers import pipeline


@pytest.mark.parametrize("stages, microbatches, repeats", [(2, 2, 1), (4, 8, 1), (4, 4, 2)])
def test_bubble_formula_and_its_cost(stages, microbatches, repeats):
    pp = pipeline.plan(16, stages, microbatches, repeats)
    assert pp.bubble == pytest.approx((stages - 1) / (microbatches * repeats + stages - 1))
    cfg = get_config("tiny").replace(num_layers=16)
    chip = chip_for("h100")
    common = dict(
        seq_len=128,
        global_batch=64,
        num_devices=16,
        remat="none",
        chip=chip,
        exposed_comm=0.0,
        overlapped_comm=0.0,
    )
    flat, piped = estimate_step(cfg, **common), estimate_step(cfg, **common, pipeline=pp)
    head = 6.0 * cfg.hidden_dim * cfg.vocab_size * 64 * 128 / 16
    layers = flat.executed_flops - head
    assert piped.executed_flops == pytest.approx(layers / (1 - pp.bubble) + head)
    assert piped.model_flops == flat.model_flops  # MFU counts the useful FLOPs only
    assert piped.bubble == pp.bubble


def _stage_replicated_bytes(cfg, name: str, mesh: dict) -> int:
    """float32 bytes per device of the parameters not split over `stage`."""
    total = 0
    for _, shape, spec in param_layouts(cfg, get_strategy(name)):
        entries = tuple(spec or ())
        if any("stage" in (e if isinstance(e, tuple) else (e,)) for e in entries):
            continue
        local = 1
        for dim, size in enumerate(shape):
            local *= size // split_size(spec, dim, mesh)
        total += 4 * local
    return total


# (target, strategy, mesh): one stage per H100 host; on the v5p slice, 2 stages of 32 chips.
ONLY_PERMUTES = [
    pytest.param("h100:2x8", "fsdp_pp", (2, 8), marks=pytest.mark.gpu_compile),
    pytest.param("h100:2x8", "fsdp_tp_pp", (2, 2, 4), marks=pytest.mark.gpu_compile),
    pytest.param("v5p:4x4x4", "fsdp_pp", (2, 32), marks=pytest.mark.tpu_compile),
    pytest.param("v5p:4x4x4", "fsdp_tp_pp", (2, 8, 4), marks=pytest.mark.tpu_compile),
]


RUN = RunConfig.from_config_dict(
    {
        "model": {"preset": "tiny", "dtype": "bfloat16", "remat": "full"},
        "data": {"seq_len": 128, "global_batch_size": 64},
    }
)


@pytest.fixture(scope="module")
def compiled():
    """(topology, strategy, mesh) -> its plan, each compiled once for this module."""
    plans = {}

    def get(topology, name, shape):
        key = (topology, name, shape)
        if key not in plans:
            plans[key] = compile_plan(RUN, Candidate(name, shape, "full", 1), make_target(topology))
        return plans[key]

    return get


@pytest.mark.gpu_compile
def test_reported_bubble_is_the_schedule_formula(compiled):
    plan = compiled("h100:2x8", "fsdp_pp", (2, 8))
    S, Mb, R = 2, 2, 1  # tiny's default: one micro-batch per stage, GPipe
    assert plan.to_json()["pipeline_bubble"] == pytest.approx((S - 1) / (Mb * R + S - 1))


@pytest.mark.parametrize("topology, name, shape", ONLY_PERMUTES)
def test_only_permutes_and_the_gradient_reduction_cross_stage(compiled, topology, name, shape):
    run = RUN
    plan = compiled(topology, name, shape)
    over_stage = [op for op in plan.collectives if "stage" in op.axes]
    permutes = [op for op in over_stage if op.op == "collective-permute"]
    # Forward and backward, per iteration and to bring the rows in and back.
    assert sum(op.executions for op in permutes) >= 4, over_stage
    others = [op for op in over_stage if op.op != "collective-permute"]
    assert {op.op for op in others} <= {"all-reduce", "reduce-scatter"}, others
    budget = _stage_replicated_bytes(run.model.decoder_config(), name, plan.mesh)
    moved = sum(op.executions * op.array_bytes for op in others)
    # 1 KiB: the loss's and the metrics' scalar sums.
    assert moved <= budget + 1024, (moved, budget, others)


@pytest.mark.parametrize(
    "stages, rows, expected",
    [(2, 8, 8), (2, 64, 8), (2, 12, 6), (2, 6, 6), (4, 16, 16), (4, 8, 8), (4, 4, 4), (4, 2, 0)],
)
def test_auto_micro_batches_are_the_largest_multiple_of_stages_up_to_4s(stages, rows, expected):
    assert pipeline_microbatches(stages, rows) == expected


def test_auto_searches_the_pipelines_with_the_micro_batches_it_chose():
    assert {"fsdp_pp", "fsdp_tp_pp"} <= set(_strategies("auto")[0])
    run = RunConfig.from_config_dict(
        {"model": {"preset": "tiny"}, "data": {"seq_len": 32, "global_batch_size": 16}}
    )
    target = Target("cpu:8", tuple(jax.devices()), chip_for("cpu", memory_gib=16))
    named = candidate_space(run, target, ["fsdp_pp"], ("full",), (1, 2), {"fsdp_pp": (2, 4)})
    assert [c.pipeline_microbatches for c in named] == [0, 0]  # the config's, as train_main
    auto = candidate_space(
        run, target, ["fsdp_pp"], ("full",), (1, 2), {"fsdp_pp": (2, 4)}, choose_pipeline=True
    )
    # 16 rows over data 4: 4 rows per data shard -> 4 micro-batches; 2 accumulation steps:
    # 2 rows -> 2.
    assert [c.pipeline_microbatches for c in auto] == [4, 2]
    assert run_for(run, auto[0]).model.pipeline_microbatches == 4
    result = search(run, target, auto[:1])
    assert result.best is not None and result.best.candidate == auto[0]
    plan = result.best.to_json()
    assert plan["pipeline_microbatches"] == 4
    assert plan["pipeline_bubble"] == pytest.approx(1 / 5)  # (S-1)/(Mb+S-1), S=2, Mb=4
    assert "pipeline_microbatches=4" in result.reason
