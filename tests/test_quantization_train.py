"""train_main with model.quantization on CPU: the loss curve stays with the float run's, and
an fp8 run stopped and resumed gives the uninterrupted run's losses bit for bit.

Small run (tests/_train_helpers.SMALL_RUN, 40 steps, 8 simulated devices, fsdp_tp) against
the same run in float32 from the same seed. Tolerance: 3% on the mean loss of the last 10
steps. The quantized runs' gradients carry rounding of 2^-4 (e4m3) / 2^-3 (e5m2) relative per
element, or 1/254 of a row's largest (int8): unbiased noise that shifts a 40-step curve by
well under a percent here (measured: see README); 3% leaves room for the seed while still
failing a broken quantizer (a wrong scale or a transposed gradient moves it by 10-100%).
bench/quantization_loss.py runs the issue's 200 steps of configs/tiny.py (2% bound).

Resume: quantization keeps no state (current scaling), so an fp8 run saved at step 20 and
restarted reproduces steps 21-40 exactly (same bits in metrics.jsonl).
"""

from __future__ import annotations

import numpy as np
import pytest
from _train_helpers import SMALL_RUN, cli_flags, run_train_main, train_losses

STEPS = 40
BASE = {
    **SMALL_RUN,
    "training.steps": STEPS,
    "optimizer.decay_steps": STEPS,  # the schedule may not depend on where a run stops
    "training.eval_every": 0,
}


def _train(workdir, quantization, **overrides):
    config = {**BASE, "model.quantization": quantization, **overrides}
    args = [f"--workdir={workdir}", "--sharding_strategy=fsdp_tp", *cli_flags(config)]
    result = run_train_main(args)
    assert result.returncode == 0, result.stderr[-3000:]
    return train_losses(str(workdir))


# Saving changes nothing a step computes: the uninterrupted fp8 run the resume test compares
# with is the fp8 run the loss-curve test reads (one 40-step run, not two).
SAVING = {"checkpoint.enabled": True, "checkpoint.every": 20}


@pytest.fixture(scope="module")
def float_losses(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("none"), "none")


@pytest.fixture(scope="module")
def fp8_whole(tmp_path_factory):
    return _train(tmp_path_factory.mktemp("fp8") / "whole", "fp8", **SAVING)


@pytest.mark.parametrize("quantization", ["fp8", "int8"])
def test_loss_curve_stays_with_the_float_run(quantization, float_losses, tmp_path, request):
    if quantization == "fp8":
        losses = request.getfixturevalue("fp8_whole")
    else:
        losses = _train(tmp_path, quantization)
    assert len(losses) == len(float_losses) == STEPS
    assert losses[-1] < losses[0] - 1.0  # it learns
    tail, ref = np.mean(losses[-10:]), np.mean(float_losses[-10:])
    assert abs(tail - ref) / ref < 0.03, (tail, ref)
    assert losses != float_losses  # quantized for real


def test_fp8_resume_equals_uninterrupted_run(fp8_whole, tmp_path):
    _train(tmp_path / "split", "fp8", **SAVING, **{"training.steps": 20})
    _train(tmp_path / "split", "fp8", **SAVING)  # resumes from step 20
    split = train_losses(str(tmp_path / "split"))
    assert len(fp8_whole) == STEPS and split == fp8_whole
