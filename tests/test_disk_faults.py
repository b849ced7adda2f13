"""Disk faults at a save (issue 31): one line, exit 1, the previous checkpoint intact.

nnx_zoo/checkpoint/write_errors.py documents the behaviour. Three ways a save fails, each through
train_main (the failing run as a process: it leaves by os._exit):
  - the disk is full before the save: the free-space check refuses to start it;
  - the free-space check passes but the write itself fails with ENOSPC (a tmpfs with bytes
    to spare and no inodes left: Orbax/TensorStore cannot create the files); the partial
    save is never taken as a checkpoint, and a run started again once there is room resumes
    from the previous one with the losses of an uninterrupted run, bit for bit;
  - the checkpoint directory is removed while the run is going.

The small filesystems are tmpfs mounts (root with CAP_SYS_ADMIN, as on the CI runner and the
development machines). Every run is SMALL_RUN for STEPS steps, saving every 2. The reference
run's workdir, less its last checkpoint, is where the disk tests start: the state of a run
that trained to step 4 and stopped before that step's save (resuming drops the metrics lines
past step 2).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from _stderr import ours
from _train_helpers import (
    ROOT,
    SMALL_RUN,
    assert_same_history,
    child_env,
    cli_flags,
    run_train_main,
    start_train_main,
    train_main_process,
)

from nnx_zoo.checkpoint import integrity
from nnx_zoo.checkpoint.steps import checkpoint_dir, complete_steps
from nnx_zoo.training.metrics import read_metrics

STEPS = 4
RUN = {
    **SMALL_RUN,
    "training.steps": STEPS,
    "training.eval_every": 0,
    "training.eval_batches": 1,
    "optimizer.warmup_steps": 0,
    "checkpoint.enabled": True,
    "checkpoint.every": 2,
}


def _mount_tmpfs(path, options: str) -> None:
    path.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run of STEPS steps, with its checkpoints at 2 and 4."""
    workdir = tmp_path_factory.mktemp("reference") / "run"
    result = run_train_main([f"--workdir={workdir}", *cli_flags(RUN)])
    assert result.returncode == 0, result.stderr[-3000:]
    assert complete_steps(checkpoint_dir(str(workdir))) == [2, STEPS]
    return workdir


def _stopped_before_the_last_save(reference, workdir) -> str:
    shutil.copytree(reference, workdir)
    shutil.rmtree(os.path.join(checkpoint_dir(str(workdir)), str(STEPS)))
    return checkpoint_dir(str(workdir))


def _one_line_exit_1(result) -> str:
    lines = ours(result.stderr).strip().splitlines()
    assert result.returncode == 1, result.stderr[-3000:]
    assert len(lines) == 1, result.stderr[-3000:]
    return lines[0]


@pytest.fixture
def disk(tmp_path):
    yield tmp_path / "disk"
    subprocess.run(["umount", "-l", str(tmp_path / "disk")], capture_output=True)


def test_full_disk_stops_with_one_line_and_keeps_the_last_checkpoint(reference, disk):
    _mount_tmpfs(disk, "size=4m")
    checkpoints = _stopped_before_the_last_save(reference, disk / "run")
    # Leave 100 KiB: metrics lines fit, a ~1.4 MiB checkpoint does not.
    stats = os.statvfs(disk)
    with open(disk / "filler", "wb") as f:
        f.write(b"\0" * (stats.f_bavail * stats.f_frsize - 100 * 1024))
    # A process: a failed save leaves by os._exit (nnx_zoo/checkpoint/write_errors.py).
    line = _one_line_exit_1(train_main_process([f"--workdir={disk / 'run'}", *cli_flags(RUN)]))
    assert line.startswith(f"error: checkpoint step {STEPS} could not be written to "), line
    assert "No space left on device: a save needs about" in line, line
    assert "the last complete checkpoint is step 2" in line, line
    # No partial save left under a step's name; the previous one matches its checksums
    # byte for byte, so it restores exactly what was saved.
    assert sorted(os.listdir(checkpoints)) == ["2"]
    assert integrity.verify(os.path.join(checkpoints, "2")) is None


def _fill_inodes(directory, leave: int) -> None:
    """Create empty files under `directory` until its filesystem has no inode left, then
    remove `leave` of them."""
    directory.mkdir()
    made = 0
    while True:
        try:
            (directory / str(made)).touch()
        except OSError:
            break
        made += 1
    for i in range(leave):
        (directory / str(made - 1 - i)).unlink()


def test_enospc_during_the_write_keeps_the_last_checkpoint_and_resumes_exactly(reference, disk):
    # Bytes to spare (the free-space check passes), 16 inodes: enough to start the run (a
    # TensorBoard file, run_info.json's temporary), not for a save's ~60 files.
    _mount_tmpfs(disk, "size=16m,nr_inodes=400")
    checkpoints = _stopped_before_the_last_save(reference, disk / "run")
    _fill_inodes(disk / "filler", leave=16)
    failed = train_main_process([f"--workdir={disk / 'run'}", *cli_flags(RUN)])
    line = _one_line_exit_1(failed)  # not Orbax's ~600 lines of background-thread traces
    assert line.startswith(f"error: checkpoint step {STEPS} could not be written to "), line
    # The write failed, not the forecast (whose reason says how much a save needs).
    assert "(No space left on device);" in line, line
    assert "the last complete checkpoint is step 2" in line, line
    # The partial save is still in Orbax's temporary directory, never under a step's name.
    assert complete_steps(checkpoints) == [2]
    assert [n for n in os.listdir(checkpoints) if n.isdigit()] == ["2"]
    assert integrity.verify(os.path.join(checkpoints, "2")) is None

    shutil.rmtree(disk / "filler")  # room again
    resumed = run_train_main([f"--workdir={disk / 'run'}", *cli_flags(RUN)])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step 2" in resumed.stdout, resumed.stdout[-2000:]
    assert sorted(os.listdir(checkpoints)) == ["2", str(STEPS)]  # the leftover is cleaned up
    want = read_metrics(os.path.join(reference, "metrics.jsonl"))
    got = read_metrics(os.path.join(disk / "run", "metrics.jsonl"))
    assert [r["step"] for r in got if "loss" in r] == list(range(1, STEPS + 1))
    assert_same_history(want, got)


def test_a_vanished_checkpoint_directory_stops_the_run_in_one_line(tmp_path):
    # Saves every 10 of 60 steps; the directory goes (a cleanup job, an unmounted volume) as
    # soon as step 10's save is complete, nine steps before the next save.
    workdir = tmp_path / "run"
    run = {**RUN, "training.steps": 60, "checkpoint.every": 10}
    checkpoints = checkpoint_dir(str(workdir))
    proc = start_train_main(
        [f"--workdir={workdir}", *cli_flags(run)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        manifest = os.path.join(checkpoints, "10", integrity.MANIFEST)
        deadline = time.monotonic() + 300
        while not os.path.exists(manifest):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no checkpoint at step 10"
            time.sleep(0.02)
        shutil.rmtree(checkpoints)
        _, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    line = _one_line_exit_1(subprocess.CompletedProcess(proc.args, proc.returncode, "", stderr))
    assert line.startswith("error: checkpoint step 20 could not be written to "), line
    assert "the checkpoint directory disappeared while the run was going" in line, line
    assert "its checkpoints (the last was step 10) went with it" in line, line
    # Not quietly recreated: an empty directory would look like a run with no history.
    assert not os.path.exists(checkpoints)
    assert max(r["step"] for r in read_metrics(workdir / "metrics.jsonl") if "loss" in r) == 20


_LATE_WAKEUP = """
import asyncio, gc, sys, time
import tensorstore as ts
from nnx_zoo.checkpoint.write_errors import failed_saves_said_once
class Other:
    def __del__(self):
        raise ValueError("an unrelated unraisable error")
hook = sys.unraisablehook
with failed_saves_said_once():  # as train_main's run is
    promise, future = ts.Promise.new()
    loop = asyncio.new_event_loop()
    async def wait():
        return await future
    task = loop.create_task(wait())
    loop.run_until_complete(asyncio.sleep(0.01))
    loop.close()  # as Orbax does once a save has failed, with this write still pending
    promise.set_result(1)  # TensorStore now wakes a closed loop
    time.sleep(0.2)
    Other()
    gc.collect()
assert sys.unraisablehook is hook  # the run's scope is undone after it
"""


def test_pending_writes_waking_a_closed_loop_print_nothing_else_does():
    # The CI failure this pins: ~100 lines of "Event loop is closed" on stderr ahead of the
    # one line of a failed save, from TensorStore writes completing after Orbax's loop closed.
    result = subprocess.run(
        [sys.executable, "-c", _LATE_WAKEUP],
        env=child_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert "Event loop is closed" not in result.stderr, result.stderr
    assert "an unrelated unraisable error" in result.stderr, result.stderr
