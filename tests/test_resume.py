"""train_main.py killed and resumed: the losses equal an uninterrupted run's, bit for bit.

One chain of runs on 8 simulated devices (fsdp_tp on the default (4, 2) mesh), B1 and B2
processes (they are killed and signalled), A and B3 in this process:
  A  an uninterrupted run of STEPS steps (the reference);
  B1 the same run, SIGKILLed as soon as its first checkpoint is complete (mid-run, possibly
     while a later save is being written; its metrics.jsonl has lines past that checkpoint);
  B2 started again on the same workdir: resumes, and gets SIGTERM mid-run -> saves at the
     step it is on, waits, exits EXIT_PREEMPTED (143);
  B3 started again: resumes from B2's step and finishes.
B's metrics.jsonl must then hold every step once, with A's losses, gradient norms and
validation loss exactly (float32 values compared as the JSON floats they were written as).
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from _train_helpers import assert_same_history, child_env, run_train_main

from nnx_zoo.checkpoint.steps import checkpoint_dir, complete_steps
from nnx_zoo.runtime.preemption import EXIT_PREEMPTED
from nnx_zoo.training.metrics import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 40
EVERY = 5
ARGS = [
    "--config=configs/tiny.py",
    "--sharding_strategy=fsdp_tp",
    f"--config.training.steps={STEPS}",
    "--config.training.eval_every=0",
    "--config.training.eval_batches=1",
    "--config.optimizer.warmup_steps=5",
    f"--config.checkpoint.every={EVERY}",
    "--config.logging.log_every=1",
    "--config.logging.progress_bar=False",
    "--config.model.hidden_dim=64",
    "--config.model.num_layers=2",
    "--config.model.ffn_dim=128",
    "--config.data.seq_len=64",
    "--config.data.global_batch_size=8",
]
TIMEOUT = 600  # a guard against a hang, not a budget: a loaded 2-core host takes minutes


def env(num_devices=8):
    e = child_env(num_devices)
    e["PYTHONPATH"] = ROOT + os.pathsep + e.get("PYTHONPATH", "")
    return e


def start(workdir, log_name):
    log = open(os.path.join(os.path.dirname(workdir), log_name), "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "train_main.py", f"--workdir={workdir}", *ARGS],
        cwd=ROOT,
        env=env(),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    return proc, log.name


def output(log_path):
    with open(log_path) as f:
        return f.read()


def finish(proc, log_path, expect_rc=0):
    rc = proc.wait(timeout=TIMEOUT)
    assert rc == expect_rc, f"exit {rc}:\n{output(log_path)[-3000:]}"


def wait_for(condition, proc, what, log_path):
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        if proc.poll() is not None:
            pytest.fail(
                f"training ended (rc {proc.returncode}) before {what}:\n{output(log_path)[-3000:]}"
            )
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)


def logged_steps(workdir):
    return [r["step"] for r in read_metrics(os.path.join(workdir, "metrics.jsonl")) if "loss" in r]


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    base = tmp_path_factory.mktemp("resume")
    reference = str(base / "reference")
    a = run_train_main([f"--workdir={reference}", *ARGS])
    assert a.returncode == 0, a.stderr[-3000:]

    workdir = str(base / "resumed")
    ckpts = checkpoint_dir(workdir)
    proc, log_b1 = start(workdir, "b1.log")
    wait_for(lambda: complete_steps(ckpts, warn=False), proc, "the first checkpoint", log_b1)
    proc.send_signal(signal.SIGKILL)
    finish(proc, log_b1, expect_rc=-signal.SIGKILL)
    killed_after = max(logged_steps(workdir))
    first_ckpt = complete_steps(ckpts)[-1]

    proc, log_b2 = start(workdir, "b2.log")
    wait_for(
        lambda: max(logged_steps(workdir), default=0) >= killed_after + 2,
        proc,
        "training past the kill point",
        log_b2,
    )
    proc.send_signal(signal.SIGTERM)
    finish(proc, log_b2, expect_rc=EXIT_PREEMPTED)  # saved: a status a scheduler requeues on
    term_step = complete_steps(ckpts)[-1]
    term_logged = logged_steps(workdir)

    b3 = run_train_main([f"--workdir={workdir}", *ARGS])
    assert b3.returncode == 0, b3.stderr[-3000:]
    return dict(
        reference=reference,
        workdir=workdir,
        killed_after=killed_after,
        first_ckpt=first_ckpt,
        term_step=term_step,
        term_logged=term_logged,
        logs={"b2": output(log_b2), "b3": b3.stdout + b3.stderr},
    )


def test_sigkill_then_resume_equals_uninterrupted_run(chain):
    assert chain["first_ckpt"] % EVERY == 0 and chain["first_ckpt"] < STEPS
    assert f"resumed from step {chain['first_ckpt']}" in chain["logs"]["b2"]
    want = read_metrics(os.path.join(chain["reference"], "metrics.jsonl"))
    got = read_metrics(os.path.join(chain["workdir"], "metrics.jsonl"))
    # Each step once (the lines B1 wrote after its checkpoint were dropped on resume).
    assert [r["step"] for r in got if "loss" in r] == list(range(1, STEPS + 1))
    assert_same_history(want, got)


def test_sigterm_saves_at_that_step_and_the_next_run_continues(chain):
    term_step = chain["term_step"]
    # B2 was stopped mid-run, after B1's kill point, and saved the step it had just finished
    # (the last one it logged) -- whether or not that step was due for a checkpoint.
    assert chain["killed_after"] < term_step < STEPS
    assert max(chain["term_logged"]) == term_step
    assert f"stopped early at step {term_step} of {STEPS} (saved)" in chain["logs"]["b2"]
    # B1 was killed holding the workdir lock: B2 took it over and said whose it was.
    assert "warning: took over the stale lock of pid" in chain["logs"]["b2"]
    assert f"resumed from step {term_step}" in chain["logs"]["b3"]
    meta_path = os.path.join(checkpoint_dir(chain["workdir"]), str(term_step), "meta", "metadata")
    if os.path.exists(meta_path):  # unless B3 rotated it out (keep=3)
        with open(meta_path) as f:
            assert json.load(f)["step"] == term_step
