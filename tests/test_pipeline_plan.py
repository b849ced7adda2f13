"""The planner knows the pipeline: compiled for two hosts of 8 H100s with one stage per host,
the step's HLO moves activations between the stages with collective-permutes over `stage`,
and the reported bubble is the schedule's, (S-1)/(Mb*R + S-1); the step-time model charges
it (the layers' FLOPs scaled by iterations / useful iterations)."""

from __future__ import annotations

import json

import pytest
from test_plan_main import _plan_main

from planning.chips import chip_for
from planning.estimate import estimate_step
from zoo import get_config
from zoo.layers import pipeline


@pytest.fixture(scope="module")
def plan():
    proc = _plan_main(
        [
            "--config=configs/tiny.py",
            "--sharding_strategy=fsdp_pp",
            "--mesh_shape=stage:2,data:8",
            "--topology=h100:2x8",
            "--batch_size=32",
            "--json",
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_stages_exchange_activations_by_collective_permute_over_stage(plan):
    assert plan["mesh"] == {"stage": 2, "data": 8}
    permutes = [
        r
        for r in plan["collectives_by_axis"]
        if r["op"] == "collective-permute" and r["axes"] == "stage"
    ]
    assert permutes and permutes[0]["count"] >= 2  # forward and backward


def test_reported_bubble_is_the_schedule_formula(plan):
    S, Mb, R = 2, 2, 1  # tiny's default: one micro-batch per stage, GPipe
    assert plan["pipeline_bubble"] == pytest.approx((S - 1) / (Mb * R + S - 1))


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
