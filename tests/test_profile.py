"""train_main's profile and step-time breakdown on CPU: `logging.profile_steps` writes a
jax.profiler trace of those steps into the workdir; metrics.jsonl splits each step's time into
data wait and compute, and says how long the loop blocked saving checkpoints."""

from __future__ import annotations

import glob
import json
import os

import pytest
from _train_helpers import SMALL_RUN, cli_flags, run_train_main, train_main_process


def test_profile_steps_and_step_time_breakdown(tmp_path):
    workdir = str(tmp_path / "run")
    overrides = {
        **SMALL_RUN,
        "training.steps": 6,
        "training.eval_every": 0,
        "checkpoint.enabled": True,
        "checkpoint.every": 3,
        "logging.profile_steps": "2:4",
    }
    # A process of its own: the profiler is process-wide state, and in a long-lived test worker
    # the trace held no train-step kernel once (random order, seed 1234, two workers).
    result = train_main_process([f"--workdir={workdir}", *cli_flags(overrides)], num_devices=2)
    assert result.returncode == 0, result.stderr[-3000:]

    # TensorBoard's profile plugin / XProf layout: plugins/profile/<run>/<host>.xplane.pb, and
    # the Chrome-trace file Perfetto opens beside it.
    traces = glob.glob(os.path.join(workdir, "profile", "plugins", "profile", "*", "*.xplane.pb"))
    assert len(traces) == 1, os.listdir(workdir)
    assert os.path.getsize(traces[0]) > 1000
    assert glob.glob(os.path.join(os.path.dirname(traces[0]), "*.trace.json.gz"))
    _check_breakdown(os.path.join(workdir, "profile"))

    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if '"loss"' in line]
    assert [r["step"] for r in records] == list(range(1, 7))
    for r in records:
        assert r["data_wait_time"] >= 0 and r["compute_time"] > 0
        # The breakdown adds up to the step time (same clock readings, float rounding only).
        assert r["data_wait_time"] + r["compute_time"] == pytest.approx(r["step_time"], rel=1e-6)
    # Step 3 saved a checkpoint; it shows as blocking time in the record after it (step 4),
    # since saving happens after a step's record is written.
    assert records[3]["checkpoint_time"] > 0
    assert records[1]["checkpoint_time"] == 0


@pytest.mark.parametrize("value", ["4:2", "x"])
def test_bad_profile_steps_exit_2_with_one_line(value, tmp_path):
    overrides = {**SMALL_RUN, "logging.profile_steps": value}
    result = run_train_main([f"--workdir={tmp_path}", *cli_flags(overrides)], num_devices=2)
    assert result.returncode == 2
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert "profile_steps" in lines[-1] and "START:END" in lines[-1], result.stderr[-2000:]


def _check_breakdown(profile_dir):
    """bench/step_breakdown.py on that trace: the compiled step written beside it names every
    traced kernel, so each lands in its category; the categories and the host gaps are the
    traced steps' time (CPU threads run kernels side by side, so they may add up to more)."""
    from bench.step_breakdown import HOST_GAPS, trace_breakdown
    from nnx_zoo.training.profile import PROGRAM_FILE

    assert os.path.getsize(os.path.join(profile_dir, PROGRAM_FILE)) > 1000
    rows = trace_breakdown(profile_dir)
    wall = rows.pop("step (wall)")
    assert wall["seconds"] > 0 and wall["kernels"] > 10
    for category in ("gemm", "lm_head_loss", "norm_rotary_elementwise", "optimizer"):
        assert rows[category]["seconds"] > 0 and rows[category]["kernels"] > 0, (category, rows)
    assert 0 <= rows[HOST_GAPS]["seconds"] < wall["seconds"]
    covered = sum(r["seconds"] for c, r in rows.items() if c != HOST_GAPS)
    assert covered + rows[HOST_GAPS]["seconds"] >= 0.99 * wall["seconds"]
    # Named kernels outside every scope (embedding, casts) are a minority of the time.
    assert rows["other"]["seconds"] < 0.5 * covered
