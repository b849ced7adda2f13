"""A smoke run extended in its own workdir (issue 50.5): 10 steps, then the same workdir with
`training.steps=60`. The config file's warmup (configs/tiny.py: 20) does not fit 10 steps and
is cut for the smoke run; the extension exits 0, keeps that warmup, and its learning rates
are the documented rule's (nnx_zoo/launch/resume.py): the schedule recomputed for 60 steps at
the restored step -- cosine's curve for the new length, WSD's stable phase going on to the new
decay window. Each step's rate is checked in metrics.jsonl against the formulas written out in
tests/test_schedules.py."""

import os

import pytest
from _train_helpers import SMALL_RUN, cli_flags, run_train_main
from test_schedules import reference

from nnx_zoo.training.metrics import read_metrics

PEAK = 3e-3
# SMALL_RUN without its warmup: the config file's 20, a value this command line does not set.
RUN = {k: v for k, v in SMALL_RUN.items() if k != "optimizer.warmup_steps"} | {
    "optimizer.learning_rate": PEAK,
    "training.eval_every": 0,
    "checkpoint.enabled": True,
    "checkpoint.every": 1000,  # the last step's save only
}


def train(workdir, steps, schedule):
    # cosine is the default: its case sets no schedule field, as a run before WSD did.
    chosen = {} if schedule == "cosine" else {"optimizer.schedule": schedule}
    args = [f"--workdir={workdir}", *cli_flags({**RUN, **chosen, "training.steps": steps})]
    return run_train_main(args, num_devices=1)


# schedule -> the warmup the 10-step run is cut to (cosine: one step after it; wsd: its
# 2-step decay window).
@pytest.mark.parametrize("schedule,warmup", [("cosine", 9), ("wsd", 8)])
def test_a_ten_step_run_extended_to_sixty(tmp_path, schedule, warmup):
    workdir = str(tmp_path)
    smoke = train(workdir, 10, schedule)
    assert smoke.returncode == 0, smoke.stderr[-2000:]
    assert f"warming up for {warmup} steps instead" in smoke.stderr
    real = train(workdir, 60, schedule)
    assert real.returncode == 0, real.stderr[-2000:]
    (line,) = [x for x in real.stdout.splitlines() if x.startswith("note: resuming at step 10")]
    assert f"the warmup stays the checkpoint's {warmup} steps, not the config's 20" in line
    assert "resumed from step 10" in real.stdout

    rates = {
        r["step"]: r["learning_rate"]
        for r in read_metrics(os.path.join(workdir, "metrics.jsonl"))
        if "learning_rate" in r
    }
    assert sorted(rates) == list(range(1, 61))
    for step, rate in rates.items():
        # metrics.jsonl's step s used the optimizer's count s - 1; steps 1-10 ran on the
        # smoke run's 10-step schedule, the rest on the 60-step one.
        length = 10 if step <= 10 else 60
        want = reference(schedule, step - 1, warmup=warmup, length=length, peak=PEAK)
        assert rate == pytest.approx(want, rel=1e-5), step
    if schedule == "wsd":  # the stable phase goes on at the peak until the new decay window
        assert all(rates[s] == pytest.approx(PEAK) for s in range(11, 49))
        assert rates[60] < rates[50] < PEAK
