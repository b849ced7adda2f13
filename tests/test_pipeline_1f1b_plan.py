"""The planner knows 1F1B: compiled for two hosts of 8 H100s (one stage per host), its step
moves nothing across `stage` but collective-permutes and the reduction of the
stage-replicated weights' gradients (the same budget as GPipe's, tests/test_pipeline_plan.py);
the plan reports the schedule, its bubble ((S-1)/(Mb+S-1), GPipe's) and its micro-batches in
flight (2S-1); the step-time model charges the LM head on one stage for every row; and
`--sharding_strategy=auto` tries both schedules for a pipeline layout and says why it
picked its own.
"""

from __future__ import annotations

import dataclasses

import jax
import pytest
from test_pipeline_plan import _stage_replicated_bytes

from nnx_zoo.planning.chips import chip_for
from nnx_zoo.planning.compile import Candidate, Target, compile_plan, make_target
from nnx_zoo.planning.estimate import estimate_step
from nnx_zoo.planning.search import cached_compile, candidate_space, search
from nnx_zoo.training.config import RunConfig
from zoo import get_config
from zoo.layers import pipeline

RUN = RunConfig.from_config_dict(
    {
        "model": {
            "preset": "tiny",
            "dtype": "bfloat16",
            "remat": "full",
            "pipeline_schedule": "1f1b",
            "pipeline_microbatches": 4,
        },
        "data": {"seq_len": 128, "global_batch_size": 64},
    }
)


@pytest.mark.gpu_compile
def test_1f1b_on_two_h100_hosts_crosses_stage_only_with_permutes():
    plan = compile_plan(RUN, Candidate("fsdp_pp", (2, 8), "full", 1), make_target("h100:2x8"))
    report = plan.to_json()
    assert report["pipeline_schedule"] == "1f1b"
    assert report["pipeline_in_flight"] == 3  # 2S-1
    assert report["pipeline_bubble"] == pytest.approx(1 / 5)  # (S-1)/(Mb+S-1), Mb = 4
    over_stage = [op for op in plan.collectives if "stage" in op.axes]
    permutes = [op for op in over_stage if op.op == "collective-permute"]
    # Activations forward in Mb + S-1 iterations and cotangents back in as many: at least a
    # micro-batch's [b, T, M] bf16 rows each way per iteration (XLA may combine the two
    # directions' permutes into one, so their count is no measure).
    cfg = RUN.model.decoder_config()
    rows_bytes = (64 // (8 * 4)) * 128 * cfg.hidden_dim * 2
    moved_by_permutes = sum(op.executions * op.array_bytes for op in permutes)
    assert moved_by_permutes >= 2 * (4 + 2 - 1) * rows_bytes, over_stage
    others = [op for op in over_stage if op.op != "collective-permute"]
    assert {op.op for op in others} <= {"all-reduce", "reduce-scatter"}, others
    budget = _stage_replicated_bytes(cfg, "fsdp_pp", plan.mesh)
    moved = sum(op.executions * op.array_bytes for op in others)
    assert moved <= budget + 1024, (moved, budget, others)  # 1 KiB: the loss's sums


def test_the_step_time_model_charges_1f1b_the_head_on_one_stage():
    cfg = get_config("tiny").replace(num_layers=16)
    common = dict(
        seq_len=128,
        global_batch=64,
        num_devices=16,
        remat="none",
        chip=chip_for("h100"),
        exposed_comm=0.0,
        overlapped_comm=0.0,
    )
    gpipe, one_f_one_b = (pipeline.plan(16, 4, 8, 1, s) for s in ("gpipe", "1f1b"))
    assert one_f_one_b.bubble == gpipe.bubble == pytest.approx(3 / 11)
    assert (one_f_one_b.in_flight, gpipe.in_flight) == (7, 11)
    g = estimate_step(cfg, **common, pipeline=gpipe)
    o = estimate_step(cfg, **common, pipeline=one_f_one_b)
    head = 6.0 * cfg.hidden_dim * cfg.vocab_size * 64 * 128 / 16
    assert o.executed_flops - g.executed_flops == pytest.approx(3 * head)  # (S-1) x a share
    assert o.model_flops == g.model_flops


def test_auto_tries_both_schedules_and_says_why():
    # remat 'none' at 128 tokens: every layer's activations, attention scores included, are
    # what GPipe keeps Mb + S-1 = 5 of and 1F1B 2S-1 = 3.
    run = RunConfig.from_config_dict(
        {"model": {"preset": "tiny"}, "data": {"seq_len": 128, "global_batch_size": 16}}
    )
    target = Target("cpu:8", tuple(jax.devices()), chip_for("cpu", memory_gib=16))
    candidates = candidate_space(
        run, target, ["fsdp_pp"], ("none",), (1,), {"fsdp_pp": (2, 4)}, choose_pipeline=True
    )
    assert [c.pipeline_schedule for c in candidates] == ["gpipe", "1f1b"]
    # A named strategy runs the config's schedule, as train_main would.
    named = candidate_space(run, target, ["fsdp_pp"], ("none",), (1,), {"fsdp_pp": (2, 4)})
    assert [c.pipeline_schedule for c in named] == [""]
    # Both fit in 16 GiB; their forecasts for this tiny model lie within 0.2% of each other
    # (which wins moved with the stage contract's per-layer casts), so the test holds the
    # search to the rule, not to a winner: the faster forecast wins and the reason names
    # the schedule it beat.
    result = search(run, target, candidates)
    best = result.best.candidate.pipeline_schedule
    other = {"gpipe": "1f1b", "1f1b": "gpipe"}[best]
    assert f"pipeline_schedule={best}: {other}" in result.reason, result.reason
    # On a chip that GPipe's activations overflow and 1F1B's do not, auto picks 1F1B and
    # names GPipe's need. The threshold sits between the two compiled footprints.
    gpipe_bytes, one_bytes = (cached_compile(run, c, target).required_bytes for c in candidates)
    assert one_bytes < gpipe_bytes, (one_bytes, gpipe_bytes)
    small = dataclasses.replace(
        target, chip=chip_for("cpu", memory_gib=(one_bytes + gpipe_bytes) / 2 / 2**30)
    )
    result = search(run, small, candidates)
    assert result.best is not None and result.best.candidate.pipeline_schedule == "1f1b"
    assert "pipeline_schedule=1f1b: gpipe needs" in result.reason, result.reason
