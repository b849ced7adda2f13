"""train_main.py never loses or duplicates work, and says what it did: one chain of runs on
one workdir (8 simulated devices, fsdp_tp on (4, 2), two Grain worker processes). A is a
process (it holds the workdir while another run starts); the others run in this process.

  A   6 steps, checkpoints at 3 and 6; a second run started while A holds the workdir exits 2
      naming A's pid; A's metrics.jsonl is one run's; no shared memory leaks at exit.
  R   checkpoint 6 damaged, a stale lock left by a dead run, `steps` raised to 9: R names the
      damaged checkpoint, takes over the lock, falls back to step 3 and reproduces A's losses
      for steps 4-6 bit for bit, on A's 6-step learning-rate schedule (given as
      optimizer.decay_steps=6: a resumed run's schedule is its own length's otherwise).
  N   A's checkpoint 6 resumed to step 9 with no worker processes: the data position does
      not depend on the worker count, so its losses are R's for steps 7-9, bit for bit.
  H   resuming with another model width: exit 2, and run_info.json still describes the run.
"""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
from _train_helpers import SMALL_RUN, TRAIN_MAIN, child_env, cli_flags, run_train_main

from nnx_zoo.checkpoint.steps import INVALID_SUBDIR, checkpoint_dir
from nnx_zoo.checkpoint.workdir import LOCK_FILE
from nnx_zoo.training.metrics import read_metrics

RUN = {
    **SMALL_RUN,
    "training.steps": 6,
    "training.eval_every": 0,
    "training.eval_batches": 1,
    "optimizer.warmup_steps": 2,
    "checkpoint.enabled": True,
    "checkpoint.every": 3,
    "data.num_workers": 2,
}
TIMEOUT = 600  # a guard against a hang, not a budget: a loaded 2-core host takes minutes


def train_main(workdir, overrides=None):
    """train_main in this process: (exit status, stdout, stderr)."""
    args = [f"--workdir={workdir}", *cli_flags({**RUN, **(overrides or {})})]
    result = run_train_main(args)
    return result.returncode, result.stdout, result.stderr


def train_main_process(workdir, overrides=None, **popen):
    args = [
        sys.executable,
        TRAIN_MAIN,
        f"--workdir={workdir}",
        *cli_flags({**RUN, **(overrides or {})}),
    ]
    return subprocess.Popen(
        args, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen
    )


def finish(proc):
    out, err = proc.communicate(timeout=TIMEOUT)
    return proc.returncode, out, err


def errors(stderr):
    return [line for line in stderr.splitlines() if line.startswith(("error:", "warning:"))]


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("run"))
    lock = os.path.join(workdir, LOCK_FILE)
    first = train_main_process(workdir)
    deadline = time.monotonic() + TIMEOUT
    while not (os.path.exists(lock) and os.path.getsize(lock)):  # A holds the workdir
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()
        time.sleep(0.2)
    second = train_main(workdir)
    first = finish(first)
    metrics_a = read_metrics(os.path.join(workdir, "metrics.jsonl"))
    with open(os.path.join(workdir, "run_info.json")) as f:
        run_info = f.read()
    out = dict(workdir=workdir, a=first, second=second, metrics_a=metrics_a, run_info=run_info)
    # N's copy of A's workdir, before R damages it.
    workdir_n = str(tmp_path_factory.mktemp("workers"))
    shutil.copytree(workdir, workdir_n, dirs_exist_ok=True)

    # A damaged latest checkpoint (4 bytes of its arrays overwritten) and a dead run's lock.
    params = os.path.join(checkpoint_dir(workdir), "6", "params")
    paths = [os.path.join(r, n) for r, _, names in os.walk(params) for n in names]
    largest = max(paths, key=os.path.getsize)
    with open(largest, "r+b") as f:
        f.seek(os.path.getsize(largest) // 2)
        f.write(b"\xde\xad\xbe\xef")
    with open(lock, "w") as f:
        f.write("pid 4194303 on host gone-host (since long ago)")
    # A's schedule, named: else steps 4-6 would run on a 9-step one (nnx_zoo/launch/resume.py).
    out["r"] = train_main(workdir, {"training.steps": 9, "optimizer.decay_steps": 6})
    out["metrics_r"] = read_metrics(os.path.join(workdir, "metrics.jsonl"))
    out["n"] = train_main(
        workdir_n, {"training.steps": 9, "optimizer.decay_steps": 6, "data.num_workers": 0}
    )
    out["metrics_n"] = read_metrics(os.path.join(workdir_n, "metrics.jsonl"))
    out["h"] = train_main(workdir, {"training.steps": 12, "model.hidden_dim": 32})
    with open(os.path.join(workdir, "run_info.json")) as f:
        out["run_info_after"] = f.read()
    return out


def test_second_run_on_a_held_workdir_exits_2_naming_the_holder(chain):
    rc, _, err = chain["second"]
    assert rc == 2, err[-2000:]
    (line,) = errors(err)
    assert line.startswith(f"error: workdir {chain['workdir']} is in use by pid "), line
    assert "on host" in line
    rc, _, err = chain["a"]
    assert rc == 0, err[-3000:]
    steps = [r["step"] for r in chain["metrics_a"] if "loss" in r]
    assert steps == list(range(1, 7))  # one run's lines, once each
    # The Grain workers' shared memory is released, and nothing fails at exit.
    assert "leaked shared_memory" not in err and "Traceback" not in err, err[-3000:]


def test_damaged_checkpoint_falls_back_and_reproduces_the_losses(chain):
    rc, out, err = chain["r"]
    assert rc == 0, err[-3000:]
    warnings = errors(err)
    directory = checkpoint_dir(chain["workdir"])
    assert (
        warnings[0] == "warning: took over the stale lock of pid 4194303 on host gone-host "
        "(since long ago), which is no longer running"
    )
    assert warnings[1].startswith(
        f"warning: checkpoint {directory}/6 is not usable (fails its integrity check: params/"
    )
    assert warnings[2] == "warning: falling back to checkpoint step 3"
    assert os.listdir(os.path.join(directory, INVALID_SUBDIR))[0].startswith("6-")
    assert sorted(os.listdir(directory)) == ["3", "6", "9", INVALID_SUBDIR]  # 6 saved again
    assert "resumed from step 3" in out
    # Steps 4-6 again from checkpoint 3: A's losses bit for bit; one history, steps once each.
    a = {r["step"]: r for r in chain["metrics_a"] if "loss" in r}
    r = {r["step"]: r for r in chain["metrics_r"] if "loss" in r}
    assert sorted(r) == list(range(1, 10))
    for step in (4, 5, 6):
        assert r[step]["loss"] == a[step]["loss"], step
        assert r[step]["learning_rate"] == a[step]["learning_rate"], step
    # Steps 6 -> 9 past the 6-step schedule it was given: the rate stays at its end value,
    # and the schedule is the checkpoint's, so there is nothing to say about it.
    assert "learning-rate schedule" not in out
    assert r[7]["learning_rate"] == r[8]["learning_rate"] == r[9]["learning_rate"]
    assert r[7]["learning_rate"] < a[6]["learning_rate"]


def test_changed_num_workers_resumes_the_same_stream(chain):
    rc, out, err = chain["n"]
    assert rc == 0, err[-3000:]
    assert "resumed from step 6" in out and not errors(err), err[-2000:]
    r = {r["step"]: r["loss"] for r in chain["metrics_r"] if "loss" in r}
    n = {r["step"]: r["loss"] for r in chain["metrics_n"] if "loss" in r}
    assert sorted(n) == list(range(1, 10))
    for step in (7, 8, 9):  # same process, devices and data: nothing may differ
        assert n[step] == r[step], step


def test_failed_resume_leaves_run_info_alone(chain):
    rc, _, err = chain["h"]
    assert rc == 2, err[-2000:]
    (line,) = errors(err)
    assert "checkpoint does not fit the model" in line
    assert json.loads(chain["run_info_after"])["config"]["model"]["hidden_dim"] == 64
    assert json.loads(chain["run_info_after"])["config"]["training"]["steps"] == 9
