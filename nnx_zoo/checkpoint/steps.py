"""The step directories under `<workdir>/checkpoints/`: which are committed (Orbax's rename),
complete (with their manifest) and good (every file matching it), and which one a step
number, or none (the newest), names. No array is read here.
"""

from __future__ import annotations

import os

from absl import logging

from nnx_zoo.checkpoint import integrity
from nnx_zoo.checkpoint.workdir import CHECKPOINT_SUBDIR
from nnx_zoo.errors import UsageError
from nnx_zoo.runtime import storage

INVALID_SUBDIR = "invalid"  # where a Checkpointer sets aside the steps it cannot use
ITEMS = ("params", "opt_state", "data_position", "meta")
LEGACY_DATA = "data"  # per-process Grain states (nnx_zoo/checkpoint/manager.py's docstring)
CHECKED = (*ITEMS, LEGACY_DATA)  # what the checksums cover, in old checkpoints too
EVAL_ITEMS = ("params", "meta")


class CorruptCheckpointError(UsageError):
    """A checkpoint whose files no longer match what was written, or that cannot be read."""


def checkpoint_dir(workdir: str) -> str:
    if storage.is_url(workdir):
        return storage.join(storage.normalize(workdir), CHECKPOINT_SUBDIR)
    return os.path.join(os.path.abspath(os.path.expanduser(workdir)), CHECKPOINT_SUBDIR)


def committed(directory: str) -> list[int]:
    """Steps Orbax has committed under `directory`. Orbax writes into a temporary directory
    and renames it to the bare step number when every process is done (its atomic-rename
    policy on local and POSIX filesystems), so integer names are exactly the committed saves.
    This is the one assumption about Orbax's files; tests/test_checkpoint.py checks it.
    On an object store there is no rename: Orbax writes `gs://` steps in place and marks them
    with `commit_success.txt` (nnx_zoo/checkpoint/remote.py uploads `s3://` ones), so an
    integer name there may be a save in progress; only the manifest, written after the
    commit, makes it complete (`complete_steps`)."""
    if not storage.is_url(directory) and not os.path.isdir(directory):
        return []
    return sorted(int(n) for n in storage.listdir(directory) if n.isdigit())


def step_dir_problem(step_dir: str) -> str | None:
    """Why `step_dir` is not a complete checkpoint (no manifest), or None when it is."""
    if integrity.read_manifest(step_dir) is None:
        if storage.isfile(storage.join(step_dir, integrity.MANIFEST)):
            return f"its {integrity.MANIFEST} is damaged (not a list of file sizes and CRC-32s)"
        return f"no {integrity.MANIFEST} (the save or its checksums did not finish)"
    return None


def complete_steps(directory: str, *, warn: bool = True) -> list[int]:
    """Steps under `directory` that are complete checkpoints, oldest first (not yet checked
    against their checksums)."""
    steps = []
    for step in committed(directory):
        problem = step_dir_problem(storage.join(directory, str(step)))
        if problem is None:
            steps.append(step)
        elif warn:
            logging.warning("skipping incomplete checkpoint %s/%d: %s", directory, step, problem)
    return steps


def check_integrity(step_dir: str, items=CHECKED) -> None:
    """Raise CorruptCheckpointError (one line, naming the step and the file) unless every
    file of `items` matches the checksums written at save time."""
    problem = integrity.verify(step_dir, items)
    if problem is not None:
        raise CorruptCheckpointError(f"checkpoint {step_dir} fails its integrity check: {problem}")


def resolve_step(directory: str, step: int | None) -> int:
    if step is None:
        found = committed(directory)
        steps = complete_steps(
            directory, warn=bool(found) and bool(complete_steps(directory, warn=False))
        )
        if not steps:
            # One line: the newest step dir and what is wrong with it.
            detail = (
                f" ({len(found)} incomplete step dirs; step {found[-1]}: "
                f"{step_dir_problem(storage.join(directory, str(found[-1])))})"
                if found
                else ""
            )
            raise UsageError(f"no complete checkpoint in {directory}{detail}")
        return steps[-1]
    step_dir = storage.join(directory, str(step))
    if not storage.isdir(step_dir):
        have = committed(directory)
        raise UsageError(f"no checkpoint for step {step} in {directory} (steps: {have})")
    problem = step_dir_problem(step_dir)
    if problem:
        raise CorruptCheckpointError(f"checkpoint {step_dir} is incomplete: {problem}")
    return step
