"""Orbax checkpoints of a training run: save asynchronously, resume exactly, restore anywhere,
and never read a damaged one.

Layout: `<workdir>/checkpoints/<step>/` with four Orbax items and our manifest,

  params          nnx.state(model, nnx.Param) as a pure dict of arrays (OCDBT, sharded writes);
                  for a LoRA run only its adapters (LoraParam), the base being run_info's init_from
  opt_state       nnx.state(optimizer, nnx.optimizer.OptState): the step count, optax's state
  data_position   JSON: the training stream's position, written once (process 0): the same
                  for every process count and worker count (nnx_zoo/data/position.py), so a run
                  resumes on any number of processes. Earlier versions wrote `data` instead,
                  one Grain state per process of streams split by process: a one-process one
                  still resumes (its state is the global stream's), others cannot (exit 2)
  meta            JSON: {'step', 'run_info' (config, strategy, mesh), and what the loop adds
                  (e.g. the RNG seed/counter)}
  checksums.json  size and CRC-32 of every file above (nnx_zoo/checkpoint/integrity.py)

The model and the optimizer are separate items so evaluation restores the parameters alone
(Orbax's StandardRestore of part of one saved tree fails on the structure mismatch).

Restoring onto any strategy and device count: the targets are built from the *live* model's
arrays (shape, dtype, sharding), so Orbax reads each shard straight into the layout the model
was built with, whatever mesh the checkpoint was written from; then `nnx.update`.

Integrity. Orbax writes a step into a temporary directory and gives it its step name only
once every process has finished, so a step directory exists only for a committed save
(`steps.committed`, the one place that relies on Orbax's behaviour). Once a save is committed, a
background thread on process 0 checksums its files and writes `checksums.json`; the training
loop never waits for it (`save` joins the previous one first, `wait`/`close` join the last).
A step directory is *complete* when its manifest is there; it is *good* when every file still
matches the manifest, which is checked once, before the first array is read:
  - training (`Checkpointer.latest_good_step`) takes the newest good step, naming each newer
    one that fails and moving it to `checkpoints/invalid/` (so that step can be saved again);
  - evaluation (`restore_params`) raises CorruptCheckpointError naming the step and the
    others it could use (`--step`).
A step with no manifest (a run killed between Orbax's commit and the manifest, or a copy cut
short) is incomplete: readers skip it with a warning, a `Checkpointer` sets it aside.

Errors are one line: UsageError when the workdir holds no complete checkpoint,
CorruptCheckpointError (a UsageError) for a damaged one, UsageError for one whose arrays do
not fit the model (the saved and the model's shapes are compared before anything is read,
naming every array that differs).
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from nnx_zoo.checkpoint import integrity, remote, write_errors
from nnx_zoo.checkpoint.restore import handlers, opt_state_tree, params_tree, restore_step
from nnx_zoo.checkpoint.steps import (
    CHECKED,
    INVALID_SUBDIR,
    check_integrity,
    checkpoint_dir,
    committed,
    complete_steps,
    resolve_step,
    step_dir_problem,
)
from nnx_zoo.checkpoint.write_errors import CheckpointWriteError, reason
from nnx_zoo.errors import UsageError
from nnx_zoo.runtime import storage
from nnx_zoo.runtime.console import warn


def _to_json(value: Any) -> Any:
    """JSON-able copy of `value` (numpy scalars/arrays to Python), checked now, in the caller's
    thread, rather than failing later in Orbax's background write."""

    def default(o):
        if isinstance(o, np.generic | np.ndarray) or hasattr(o, "__array__"):
            return np.asarray(o).tolist()
        raise TypeError(f"checkpoint meta holds a {type(o).__name__}, which is not JSON-able")

    return json.loads(json.dumps(value, default=default))


class Checkpointer:
    """Saves and restores a run's model, optimizer, data iterator and metadata.

    Args:
      workdir: the run's directory; checkpoints go to `<workdir>/checkpoints/`.
      save_every: `save(step)` writes when `step % save_every == 0` (or `force=True`).
      keep: how many of the newest checkpoints to keep.
      run_info: JSON-able dict saved in every checkpoint's meta (the run's config as
        `RunConfig.to_dict()` under 'config', the strategy, the mesh shape); `eval_main.py`
        rebuilds the model from its 'config'.
      async_save: write in the background; `save` blocks only for the device-to-host copy.
    """

    def __init__(
        self,
        workdir: str,
        *,
        save_every: int,
        keep: int,
        run_info: dict,
        async_save: bool = True,
    ):
        if save_every < 1 or keep < 1:
            raise UsageError(f"checkpoint save_every={save_every} and keep={keep} must be >= 1")
        self.directory = checkpoint_dir(workdir)
        self.keep = keep
        # Where Orbax writes: the checkpoint directory itself, or (s3://) a local staging
        # directory whose committed steps are uploaded (nnx_zoo/checkpoint/remote.py).
        self._uploads = not remote.orbax_writes(self.directory)
        if self._uploads and jax.process_count() > 1:
            raise UsageError(
                f"{self.directory}: s3:// checkpoints are staged on process 0's disk and "
                "uploaded, which cannot gather the other processes' shards; with several "
                "processes use a gs:// or shared local --workdir"
            )
        self._orbax_dir = (
            remote.staging_dir("nnx-zoo-checkpoints-") if self._uploads else self.directory
        )
        self.save_every = save_every
        self.run_info = _to_json(run_info)
        self.last_save_blocking_s: float | None = None  # for benchmarks and logs
        self.last_checksum_s: float | None = None  # background time of the last manifest
        self._manifest_thread: threading.Thread | None = None
        self._manifest_error: BaseException | None = None
        self._verified: set[int] = set()
        self._last_saved: int | None = None  # newest step this run saved with its checksums
        self._saving: int | None = None  # the step of the save started last
        self._set_aside(
            {s: p for s in committed(self.directory) if (p := self._problem_p0(s)) is not None}
        )
        self._manager = ocp.CheckpointManager(
            self._orbax_dir,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep,
                enable_async_checkpointing=async_save,
                cleanup_tmp_directories=True,  # leftovers of a save cut short
            ),
            item_handlers=handlers(),
        )

    def due(self, step: int) -> bool:
        """Whether `step` is one to save at (every `save_every` steps): the one place the
        save cadence is decided; the training loop asks before it syncs anything to save."""
        return step % self.save_every == 0

    def _problem_p0(self, step: int) -> str | None:
        if jax.process_index() != 0:
            return None
        return step_dir_problem(storage.join(self.directory, str(step)))

    def _set_aside(self, problems: dict[int, str]) -> None:
        """Move the given step dirs to checkpoints/invalid/ (process 0; the others wait), so
        they are never resumed from and their step can be saved again."""
        if jax.process_index() == 0:
            for step, problem in sorted(problems.items()):
                step_dir = storage.join(self.directory, str(step))
                target = storage.join(
                    self.directory, INVALID_SUBDIR, f"{step}-{time.strftime('%Y%m%d-%H%M%S')}"
                )
                # A rename on disk; on an object store a copy, then the step's deletion.
                storage.move_tree(step_dir, target)
                warn(f"checkpoint {step_dir} is not usable ({problem}); moved to {target}")
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("checkpoint: set aside unusable steps")

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, not yet checked against its checksums."""
        steps = complete_steps(self.directory)
        return steps[-1] if steps else None

    def latest_good_step(self) -> int | None:
        """The newest checkpoint whose files all match their checksums, or None. Each newer
        one that fails is named on stderr and set aside; process 0 checks and tells the
        others, so every process resumes from the same step."""
        steps = complete_steps(self.directory)
        good, bad = -1, {}
        if jax.process_index() == 0:
            for step in reversed(steps):
                problem = integrity.verify(storage.join(self.directory, str(step)), CHECKED)
                if problem is None:
                    good = step
                    break
                bad[step] = f"fails its integrity check: {problem}"
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            good = int(multihost_utils.broadcast_one_to_all(np.int64(good)))
        if bad:
            self._set_aside(bad)
            self._manager.reload()  # it listed the steps set aside; they may be saved again
            warn(
                f"falling back to checkpoint step {good}"
                if good >= 0
                else "no checkpoint passes its integrity check; starting from step 0"
            )
        elif jax.process_count() > 1:
            self._set_aside({})  # the others wait for process 0 either way
        if good < 0:
            return None
        self._verified.add(good)
        self._last_saved = good
        return good

    def restore(self, step: int, *, model, optimizer=None, data_iter=None) -> dict:
        """Restore `step` in place onto the live model / optimizer / iterator (their current
        shardings, whatever mesh wrote the checkpoint). Returns the saved meta dict.
        Checks the checksums first unless `latest_good_step` just did."""
        step = resolve_step(self.directory, step)
        step_dir = storage.join(self.directory, str(step))
        if step not in self._verified:
            check_integrity(step_dir, CHECKED)
        return restore_step(step_dir, model=model, optimizer=optimizer, data_iter=data_iter)

    def save(
        self,
        step: int,
        *,
        model,
        optimizer,
        data_iter,
        meta: dict | None = None,
        force: bool = False,
    ) -> bool:
        """Start saving `step` when it is due (or `force`); False when nothing was started
        (not due, or this step is already saved). Returns once the arrays are copied to host
        memory (async) or written (sync); buffers may be donated right after. The checksums
        are written in the background once Orbax has committed the step."""
        step = int(step)
        if not force and not self.due(step):
            return False
        self._join_manifest()
        if (
            self._last_saved is not None
            and not storage.is_url(self.directory)
            and not os.path.isdir(self.directory)
        ):
            # Orbax would quietly create it again, and the run's history would be gone.
            raise CheckpointWriteError(
                step,
                "the checkpoint directory disappeared while the run was going",
                None,
                self.directory,
                kept=f"its checkpoints (the last was step {self._last_saved}) went with it",
            )
        if step in self._manager.all_steps() or (self._uploads and step == self._last_saved):
            return False
        params, opt_state = params_tree(model), opt_state_tree(optimizer)
        problem = None
        if not storage.is_url(self._orbax_dir):  # a bucket has no free-space figure
            needed = self._needed_bytes(params, opt_state)
            problem = write_errors.lacks_space(self._orbax_dir, needed)
        if problem:  # before Orbax starts: no partial write, no background failure
            raise CheckpointWriteError(step, problem, self._last_saved, self.directory)
        self._saving = step
        record = _to_json({**(meta or {}), "step": step, "run_info": self.run_info})
        args = ocp.args.Composite(
            params=ocp.args.StandardSave(params),
            opt_state=ocp.args.StandardSave(opt_state),
            # Every process holds the same position; Orbax writes it from process 0.
            data_position=ocp.args.JsonSave(_to_json(data_iter.get_state())),
            meta=ocp.args.JsonSave(record),
        )
        start = time.perf_counter()
        try:
            self._manager.save(step, args=args, force=True)
        except Exception as e:  # noqa: BLE001 -- any failure to write: one line (write_errors)
            raise self._write_error(step, e) from e
        self.last_save_blocking_s = time.perf_counter() - start
        self._manifest_thread = threading.Thread(
            target=self._write_manifest, args=(step,), name=f"checksums-{step}", daemon=True
        )
        self._manifest_thread.start()
        return True

    def _write_manifest(self, step: int) -> None:
        try:
            self._manager.wait_until_finished()  # committed: the step dir has its name
            if jax.process_index() == 0:
                start = time.perf_counter()
                integrity.write_manifest(storage.join(self._orbax_dir, str(step)))
                if self._uploads:
                    self._upload(step)
                self.last_checksum_s = time.perf_counter() - start
            self._last_saved = step
        except Exception as e:  # noqa: BLE001 -- re-raised in the main thread by _join
            self._manifest_error = self._write_error(step, e)
            self._manifest_error.__cause__ = e
        except BaseException as e:  # noqa: BLE001 -- re-raised in the main thread by _join
            self._manifest_error = e

    def _upload(self, step: int) -> None:
        """Copy a committed staged step to the object store, then keep only the newest
        `keep` steps there (Orbax prunes the staging directory itself)."""
        remote.upload_step(
            os.path.join(self._orbax_dir, str(step)),
            storage.join(self.directory, str(step)),
            integrity.MANIFEST,
        )
        for old in complete_steps(self.directory, warn=False)[: -self.keep]:
            storage.rmtree(storage.join(self.directory, str(old)))

    def _needed_bytes(self, params, opt_state) -> int:
        """What the next save will write: the last save's files (its manifest's sizes), or,
        before any, the arrays' bytes."""
        if self._last_saved is not None:
            manifest = integrity.read_manifest(storage.join(self.directory, str(self._last_saved)))
            if manifest is not None:
                return sum(f["size"] for f in manifest["files"].values())
        leaves = jax.tree.leaves((params, opt_state))
        return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in leaves)

    def _write_error(self, step: int, error: BaseException) -> CheckpointWriteError:
        last = self._last_saved
        return CheckpointWriteError(step, reason(error), last, self.directory)

    def _join_manifest(self) -> None:
        if self._manifest_thread is not None:
            self._manifest_thread.join()
            self._manifest_thread = None
        if self._manifest_error is not None:
            error, self._manifest_error = self._manifest_error, None
            raise error

    def wait(self) -> None:
        """Block until every started save is on disk with its checksums."""
        self._join_manifest()
        try:
            self._manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001 -- any failure to write: one line (write_errors)
            raise self._write_error(self._saving or -1, e) from e

    def close(self) -> None:
        self.wait()
        self._manager.close()
