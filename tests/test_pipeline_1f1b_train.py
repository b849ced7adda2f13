"""train_main with `--config.model.pipeline_schedule=1f1b` (issue 41, check 1): under fsdp_pp on
2 stages x 4 data shards with 4 micro-batches and remat `full`, its losses and validation losses
equal a `dp` run's (every row on one device's arithmetic with the whole model: the one-device
run, which train_main cannot make in a process that holds 8 devices), float32 within 1e-5
relative (the pipeline only reorders which rows run when, and sums the micro-batches' gradients
in another order; the runs agree to ~1e-7); its checkpoint evaluates under `dp` to its own last
validation loss; and a schedule that cannot run is one line with exit status 2.

Everything runs in-process (tests/_entry.py): one compile per run.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from _entry import evaluate, train
from _train_helpers import SMALL_RUN, cli_flags, train_losses

STEPS = 4
RUN = {
    **SMALL_RUN,
    "training.steps": STEPS,
    "optimizer.decay_steps": STEPS,
    "training.eval_every": STEPS,
    "checkpoint.enabled": True,
    "checkpoint.every": STEPS,
    # Each layer recomputed in the backward (the equality tests run 'none' and 'dots').
    "model.remat": "full",
}
ONE_F_ONE_B = [
    "--sharding_strategy=fsdp_pp",
    "--mesh_shape=stage:2,data:4",
    "--config.model.pipeline_schedule=1f1b",
    "--config.model.pipeline_microbatches=4",
]


def _train(workdir, flags):
    result = train([f"--workdir={workdir}", *flags, *cli_flags(RUN)])
    assert result.returncode == 0, result.stderr[-3000:]
    return workdir


def _val_losses(workdir) -> list[float]:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [r["val_loss"] for r in map(json.loads, f) if "val_loss" in r]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    piped = _train(str(tmp_path_factory.mktemp("1f1b")), ONE_F_ONE_B)
    flat = _train(str(tmp_path_factory.mktemp("dp")), ["--sharding_strategy=dp"])
    return piped, flat


def test_1f1b_trains_as_one_device(runs):
    piped, flat = runs
    losses = train_losses(piped)
    assert len(losses) == STEPS
    np.testing.assert_allclose(losses, train_losses(flat), rtol=1e-5)
    np.testing.assert_allclose(_val_losses(piped), _val_losses(flat), rtol=1e-5)
    with open(os.path.join(piped, "run_info.json")) as f:
        info = json.load(f)
    assert info["config"]["model"]["pipeline_schedule"] == "1f1b", info["config"]["model"]


def test_1f1b_checkpoint_evaluates_under_dp(runs):
    piped, _ = runs
    result = evaluate([f"--workdir={piped}", "--sharding_strategy=dp"])
    assert result.returncode == 0, result.stderr[-3000:]
    with open(os.path.join(piped, "eval.json")) as f:
        evaluated = json.load(f)
    assert evaluated["step"] == STEPS
    np.testing.assert_allclose(evaluated["loss"], _val_losses(piped)[-1], rtol=1e-5)


def test_1f1b_with_repeats_is_one_line(tmp_path):
    flags = [*ONE_F_ONE_B, "--config.model.pipeline_repeats=2", "--config.model.num_layers=4"]
    result = train([f"--workdir={tmp_path}", *flags, *cli_flags(SMALL_RUN)])
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert result.returncode == 2, result.stderr[-2000:]
    assert len(lines) == 1, result.stderr[-2000:]
    assert "pipeline_schedule='1f1b' with pipeline_repeats=2" in lines[0]
    assert not os.listdir(tmp_path)  # refused before anything was written
