"""A full disk at a save (issue 31): one line, exit 1, and the previous checkpoint intact.

The workdir is a small tmpfs (mounting needs root with CAP_SYS_ADMIN, as on the CI runner and
the development machines); the test fills it after the first save, so the next save does not
fit. checkpoint/write_errors.py documents the behaviour: the save is not started, the run
stops with one line naming the step, the reason and the last complete checkpoint.
"""

from __future__ import annotations

import os
import subprocess

import pytest
from _train_helpers import SMALL_RUN, cli_flags, run_train_main

RUN = {
    **SMALL_RUN,
    "training.steps": 2,
    "training.eval_every": 0,
    "training.eval_batches": 1,
    "optimizer.warmup_steps": 0,
    "checkpoint.enabled": True,
    "checkpoint.every": 2,
}


@pytest.fixture
def small_disk(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    yield disk
    subprocess.run(["umount", "-l", str(disk)])


def test_full_disk_stops_with_one_line_and_keeps_the_last_checkpoint(small_disk):
    from checkpoint import integrity
    from checkpoint.manager import complete_steps

    workdir = small_disk / "run"
    first = run_train_main([f"--workdir={workdir}", *cli_flags(RUN)])
    assert first.returncode == 0, first.stderr[-3000:]
    checkpoints = str(workdir / "checkpoints")
    assert complete_steps(checkpoints) == [2]
    # Leave 100 KiB: metrics lines fit, a ~1.4 MiB checkpoint does not.
    stats = os.statvfs(small_disk)
    with open(small_disk / "filler", "wb") as f:
        f.write(b"\0" * (stats.f_bavail * stats.f_frsize - 100 * 1024))
    second = run_train_main([f"--workdir={workdir}", *cli_flags({**RUN, "training.steps": 4})])
    lines = second.stderr.strip().splitlines()
    assert second.returncode == 1, second.stderr[-3000:]
    assert len(lines) == 1, second.stderr[-3000:]
    assert lines[0].startswith("error: checkpoint step 4 could not be written to ")
    assert "No space left on device" in lines[0]
    assert "the last complete checkpoint is step 2" in lines[0]
    # No partial save left under a step's name; the previous one matches its checksums
    # byte for byte, so it restores exactly what was saved.
    assert sorted(os.listdir(checkpoints)) == ["2"]
    assert integrity.verify(os.path.join(checkpoints, "2")) is None


def test_a_vanished_checkpoint_directory_fails_the_next_save(tmp_path):
    import shutil

    from test_checkpoint import build, data_iter

    from checkpoint.manager import Checkpointer, checkpoint_dir
    from checkpoint.write_errors import CheckpointWriteError

    _, model, optimizer = build("dp", (8,))
    it = data_iter()
    ckpt = Checkpointer(str(tmp_path), save_every=1, keep=2, run_info={})
    assert ckpt.save(1, model=model, optimizer=optimizer, data_iter=it)
    ckpt.wait()
    shutil.rmtree(checkpoint_dir(str(tmp_path)))  # a cleanup job, an unmounted volume
    with pytest.raises(CheckpointWriteError, match="disappeared while the run was going") as info:
        ckpt.save(2, model=model, optimizer=optimizer, data_iter=it)
    assert "\n" not in str(info.value) and str(info.value).startswith("checkpoint step 2 ")
    # Not quietly recreated: an empty directory would look like a run with no history.
    assert not os.path.exists(checkpoint_dir(str(tmp_path)))
