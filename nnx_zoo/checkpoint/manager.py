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
(`_committed`, the one place that relies on Orbax's behaviour). Once a save is committed, a
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

Errors are one line: FileNotFoundError when the workdir holds no complete checkpoint,
CorruptCheckpointError (a ValueError) for a damaged one, ValueError for one whose arrays do
not fit the model (the saved and the model's shapes are compared before anything is read,
naming every array that differs).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from flax import nnx
from jax.sharding import AbstractMesh, NamedSharding

from nnx_zoo.checkpoint import integrity, write_errors
from nnx_zoo.checkpoint.workdir import CHECKPOINT_SUBDIR
from nnx_zoo.checkpoint.write_errors import CheckpointWriteError, reason
from zoo import VOCAB_DIMS

# What `params` holds: every nnx.Param, or for a LoRA run only its adapters (the frozen base
# is the run's --init_from directory, which run_info.json names).
from zoo.layers.lora import trainable

INVALID_SUBDIR = "invalid"
ITEMS = ("params", "opt_state", "data_position", "meta")
_LEGACY_DATA = "data"  # per-process Grain states (module docstring)
_CHECKED = (*ITEMS, _LEGACY_DATA)  # what the checksums cover, in old checkpoints too
_TREE_ITEMS = ("params", "opt_state")
EVAL_ITEMS = ("params", "meta")


class CorruptCheckpointError(ValueError):
    """A checkpoint whose files no longer match what was written, or that cannot be read."""


def checkpoint_dir(workdir: str) -> str:
    return os.path.join(os.path.abspath(os.path.expanduser(workdir)), CHECKPOINT_SUBDIR)


def _handlers() -> dict[str, Any]:
    return {
        "params": ocp.StandardCheckpointHandler(),
        "opt_state": ocp.StandardCheckpointHandler(),
        "data_position": ocp.JsonCheckpointHandler(),
        _LEGACY_DATA: grain.checkpoint.CheckpointHandler(),
        "meta": ocp.JsonCheckpointHandler(),
    }


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    first = text[0] if text else ""
    # tensorstore errors can embed the repr of a bound pybind11 method: cut it off.
    first = first.split("<bound method", 1)[0].rstrip(" :(")
    return f"{type(error).__name__}: {first}"[:300]


def _warn(text: str) -> None:
    """One line on stderr from process 0: what a reader skipped or set aside, and why."""
    if jax.process_index() == 0:
        print(f"warning: {text}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- step dirs


def _committed(directory: str) -> list[int]:
    """Steps Orbax has committed under `directory`. Orbax writes into a temporary directory
    and renames it to the bare step number when every process is done (its atomic-rename
    policy on local and POSIX filesystems), so integer names are exactly the committed saves.
    This is the one assumption about Orbax's files; tests/test_checkpoint.py checks it."""
    if not os.path.isdir(directory):
        return []
    return sorted(int(n) for n in os.listdir(directory) if n.isdigit())


def step_dir_problem(step_dir: str) -> str | None:
    """Why `step_dir` is not a complete checkpoint (no manifest), or None when it is."""
    if integrity.read_manifest(step_dir) is None:
        if os.path.isfile(os.path.join(step_dir, integrity.MANIFEST)):
            return f"its {integrity.MANIFEST} is damaged (not a list of file sizes and CRC-32s)"
        return f"no {integrity.MANIFEST} (the save or its checksums did not finish)"
    return None


def complete_steps(directory: str, *, warn: bool = True) -> list[int]:
    """Steps under `directory` that are complete checkpoints, oldest first (not yet checked
    against their checksums)."""
    steps = []
    for step in _committed(directory):
        problem = step_dir_problem(os.path.join(directory, str(step)))
        if problem is None:
            steps.append(step)
        elif warn:
            logging.warning("skipping incomplete checkpoint %s/%d: %s", directory, step, problem)
    return steps


def check_integrity(step_dir: str, items=_CHECKED) -> None:
    """Raise CorruptCheckpointError (one line, naming the step and the file) unless every
    file of `items` matches the checksums written at save time."""
    problem = integrity.verify(step_dir, items)
    if problem is not None:
        raise CorruptCheckpointError(f"checkpoint {step_dir} fails its integrity check: {problem}")


def _resolve_step(directory: str, step: int | None) -> int:
    if step is None:
        found = _committed(directory)
        steps = complete_steps(
            directory, warn=bool(found) and bool(complete_steps(directory, warn=False))
        )
        if not steps:
            # One line: the newest step dir and what is wrong with it.
            detail = (
                f" ({len(found)} incomplete step dirs; step {found[-1]}: "
                f"{step_dir_problem(os.path.join(directory, str(found[-1])))})"
                if found
                else ""
            )
            raise FileNotFoundError(f"no complete checkpoint in {directory}{detail}")
        return steps[-1]
    step_dir = os.path.join(directory, str(step))
    if not os.path.isdir(step_dir):
        have = _committed(directory)
        raise FileNotFoundError(f"no checkpoint for step {step} in {directory} (steps: {have})")
    problem = step_dir_problem(step_dir)
    if problem:
        raise CorruptCheckpointError(f"checkpoint {step_dir} is incomplete: {problem}")
    return step


# ----------------------------------------------------------------------------- trees


def _flatten(tree: Mapping, prefix: str = "") -> dict[str, Any]:
    """Nested dict -> {'a/b/c': leaf}; keys as strings (Orbax stores int keys as text)."""
    flat = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, path + "/"))
        else:
            flat[path] = value
    return flat


def _abstract(tree):
    """Restore targets: each array's shape, dtype and sharding (the model's layout). Leaves
    may be live arrays or the ShapeDtypeStructs of an `nnx.eval_shape` model, whose shardings
    name the abstract mesh; those are bound to the active concrete mesh (`jax.set_mesh`)."""

    def target(x):
        sharding = x.sharding
        if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, AbstractMesh):
            mesh = jax.sharding.get_mesh()
            if mesh is None or mesh.empty:
                raise ValueError("restoring onto an abstract model needs `with jax.set_mesh(mesh)`")
            sharding = NamedSharding(mesh, sharding.spec)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return jax.tree.map(target, tree)


def _vocab_dim(path: str) -> int | None:
    """The vocab dim of a saved array's path (a param, or optimizer state shaped like one),
    or None."""
    for key, dim in VOCAB_DIMS.items():
        if path == key or path.endswith("/" + key):
            return dim
    return None


def check_fits(
    saved_tree: Mapping, live_tree: Mapping, what: str, *, vocab_padding_differs: bool = False
) -> bool:
    """One-line ValueError naming every array whose saved shape or dtype differs, or that only
    one side has. With `vocab_padding_differs` (the saved model has the same vocabulary, padded
    for another mesh: zoo.plan.fit_vocab), arrays may differ in their vocab dim alone; returns
    whether any does (then the restore pads or cuts those rows, which hold no token)."""
    saved, live = _flatten(saved_tree), _flatten(live_tree)
    diffs, resized = [], False
    for path in sorted(saved.keys() | live.keys()):
        if path not in live:
            diffs.append(f"{path} saved {tuple(saved[path].shape)} but not in the model")
        elif path not in saved:
            diffs.append(f"{path} missing from the checkpoint (model {tuple(live[path].shape)})")
        else:
            s, m = saved[path], live[path]
            if tuple(s.shape) != tuple(m.shape):
                dim = _vocab_dim(path) if vocab_padding_differs else None
                others = [d for d in range(len(m.shape)) if d != dim]
                if (
                    dim is not None
                    and len(s.shape) == len(m.shape)
                    and all(s.shape[d] == m.shape[d] for d in others)
                ):
                    resized = True
                else:
                    diffs.append(f"{path} saved {tuple(s.shape)} vs model {tuple(m.shape)}")
            elif np.dtype(s.dtype) != np.dtype(m.dtype):
                diffs.append(f"{path} saved {np.dtype(s.dtype)} vs model {np.dtype(m.dtype)}")
    if diffs:
        raise ValueError(f"checkpoint does not fit the {what}: " + "; ".join(diffs))
    return resized


def _params(model) -> dict:
    return nnx.to_pure_dict(nnx.state(model, trainable(model)))


def _opt_state(optimizer) -> dict:
    return nnx.to_pure_dict(nnx.state(optimizer, nnx.optimizer.OptState))


def _params_args(model) -> dict[str, Any]:
    """Orbax restore arguments for the parameters, in the live model's layout."""
    return {"params": ocp.args.StandardRestore(_abstract(_params(model)))}


def _unreadable(step_dir: str, error: BaseException, what: str = "") -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"checkpoint {step_dir} {what}cannot be read ({_one_line(error)})"
    )


def _put_back(module, var_filter, restored: dict) -> None:
    state = nnx.state(module, var_filter)
    nnx.replace_by_pure_dict(state, restored)
    nnx.update(module, state)


def _restore(step_dir: str, what: str, args: dict[str, Any], model_cfg=None) -> dict:
    """Read `args`' items from `step_dir`, shape-checking the tree items against their
    targets before any array is read. `model_cfg`: the live model's config, whose vocabulary
    padding may differ from the saved one's (then those rows are padded or cut)."""
    same_vocab = False
    if model_cfg is not None:
        saved_cfg = (_read_meta(step_dir).get("run_info") or {}).get("model_config") or {}
        same_vocab = saved_cfg.get("vocab_size") == model_cfg.vocab_size
    checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler(**_handlers()))
    try:
        try:
            metadata = checkpointer.metadata(step_dir).item_metadata
        except Exception as e:  # noqa: BLE001 -- any failure to read it means a damaged dir
            raise _unreadable(step_dir, e) from e
        args = dict(args)
        for item in _TREE_ITEMS:
            if item in args:
                saved = getattr(metadata.get(item), "tree", None)
                if saved is None:
                    raise CorruptCheckpointError(f"checkpoint {step_dir} holds no {item} tree")
                target = args[item].item
                name = what if item == "params" else "optimizer"
                if check_fits(saved, target, name, vocab_padding_differs=same_vocab):
                    # Orbax pads (zeros) or cuts arrays to the target's shape when not strict.
                    args[item] = ocp.args.StandardRestore(target, strict=False)
        try:
            return checkpointer.restore(step_dir, args=ocp.args.Composite(**args))
        except Exception as e:  # noqa: BLE001 -- tensorstore/OCDBT errors past the checksums
            raise _unreadable(step_dir, e) from e
    finally:
        checkpointer.close()


def _to_json(value: Any) -> Any:
    """JSON-able copy of `value` (numpy scalars/arrays to Python), checked now, in the caller's
    thread, rather than failing later in Orbax's background write."""

    def default(o):
        if isinstance(o, np.generic | np.ndarray) or hasattr(o, "__array__"):
            return np.asarray(o).tolist()
        raise TypeError(f"checkpoint meta holds a {type(o).__name__}, which is not JSON-able")

    return json.loads(json.dumps(value, default=default))


# ----------------------------------------------------------------------------- training side


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
            raise ValueError(f"checkpoint save_every={save_every} and keep={keep} must be >= 1")
        self.directory = checkpoint_dir(workdir)
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
            {s: p for s in _committed(self.directory) if (p := self._problem_p0(s)) is not None}
        )
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep,
                enable_async_checkpointing=async_save,
                cleanup_tmp_directories=True,  # leftovers of a save cut short
            ),
            item_handlers=_handlers(),
        )

    def _problem_p0(self, step: int) -> str | None:
        if jax.process_index() != 0:
            return None
        return step_dir_problem(os.path.join(self.directory, str(step)))

    def _set_aside(self, problems: dict[int, str]) -> None:
        """Move the given step dirs to checkpoints/invalid/ (process 0; the others wait), so
        they are never resumed from and their step can be saved again."""
        if jax.process_index() == 0:
            for step, problem in sorted(problems.items()):
                step_dir = os.path.join(self.directory, str(step))
                target = os.path.join(
                    self.directory, INVALID_SUBDIR, f"{step}-{time.strftime('%Y%m%d-%H%M%S')}"
                )
                os.makedirs(os.path.dirname(target), exist_ok=True)
                shutil.move(step_dir, target)
                _warn(f"checkpoint {step_dir} is not usable ({problem}); moved to {target}")
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
                problem = integrity.verify(os.path.join(self.directory, str(step)), _CHECKED)
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
            _warn(
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
        step = _resolve_step(self.directory, step)
        step_dir = os.path.join(self.directory, str(step))
        if step not in self._verified:
            check_integrity(step_dir, _CHECKED)
        args = _params_args(model)
        if optimizer is not None:
            args["opt_state"] = ocp.args.StandardRestore(_abstract(_opt_state(optimizer)))
        legacy_data = None
        if data_iter is not None:
            if os.path.isdir(os.path.join(step_dir, "data_position")):
                args["data_position"] = ocp.args.JsonRestore()
            else:
                legacy_data = _legacy_data_state(step_dir)
        args["meta"] = ocp.args.JsonRestore()
        restored = _restore(step_dir, "model", args, getattr(model, "cfg", None))
        _put_back(model, trainable(model), restored["params"])
        if optimizer is not None:
            _put_back(optimizer, nnx.optimizer.OptState, restored["opt_state"])
        if data_iter is not None:
            data_iter.set_state(legacy_data or dict(restored["data_position"]))
        logging.info("restored checkpoint %s", step_dir)
        return dict(restored["meta"])

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
        if not force and step % self.save_every:
            return False
        self._join_manifest()
        if self._last_saved is not None and not os.path.isdir(self.directory):
            # Orbax would quietly create it again, and the run's history would be gone.
            raise CheckpointWriteError(
                step,
                "the checkpoint directory disappeared while the run was going",
                None,
                self.directory,
                kept=f"its checkpoints (the last was step {self._last_saved}) went with it",
            )
        if step in self._manager.all_steps():
            return False
        params, opt_state = _params(model), _opt_state(optimizer)
        problem = write_errors.lacks_space(self.directory, self._needed_bytes(params, opt_state))
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
                integrity.write_manifest(os.path.join(self.directory, str(step)))
                self.last_checksum_s = time.perf_counter() - start
            self._last_saved = step
        except Exception as e:  # noqa: BLE001 -- re-raised in the main thread by _join
            self._manifest_error = self._write_error(step, e)
            self._manifest_error.__cause__ = e
        except BaseException as e:  # noqa: BLE001 -- re-raised in the main thread by _join
            self._manifest_error = e

    def _needed_bytes(self, params, opt_state) -> int:
        """What the next save will write: the last save's files (its manifest's sizes), or,
        before any, the arrays' bytes."""
        if self._last_saved is not None:
            manifest = integrity.read_manifest(os.path.join(self.directory, str(self._last_saved)))
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


def _legacy_data_state(step_dir: str) -> dict:
    """The data position of a checkpoint written before positions were global: Grain's
    per-process files `process_<i>-of-<n>.json`. A one-process run's state is a state of the
    global stream (its pipeline saw every document); with n > 1 each file is a position in
    that process's own share of the documents, which no longer exists."""
    data_dir = os.path.join(step_dir, _LEGACY_DATA)
    names = os.listdir(data_dir) if os.path.isdir(data_dir) else []
    saved = sorted(n for n in names if n.startswith("process_") and n.endswith(".json"))
    if not saved:
        raise CorruptCheckpointError(f"checkpoint {step_dir} holds no data position")
    if saved != ["process_0-of-1.json"]:
        raise ValueError(
            f"checkpoint {step_dir} keeps one data position per process ({', '.join(saved)}), "
            "in streams split by process, which this version no longer has: resume it with the "
            "version that wrote it, or change a data field (e.g. --config.data.shuffle_seed) "
            "to restart the data stream, keeping the model and optimizer"
        )
    with open(os.path.join(data_dir, saved[0])) as f:
        return json.load(f)


# ----------------------------------------------------------------------------- evaluation side


def _read_meta(step_dir: str) -> dict:
    checkpointer = ocp.Checkpointer(
        ocp.CompositeCheckpointHandler(meta=ocp.JsonCheckpointHandler())
    )
    try:
        restored = checkpointer.restore(
            step_dir, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
        )
    except Exception as e:  # noqa: BLE001 -- any failure to read it means a damaged dir
        raise _unreadable(step_dir, e, "meta ") from e
    finally:
        checkpointer.close()
    return dict(restored["meta"])


def read_meta(workdir: str, step: int | None = None) -> tuple[int, dict]:
    """(step, meta) of the latest complete checkpoint (or `step`) without reading arrays."""
    directory = checkpoint_dir(workdir)
    step = _resolve_step(directory, step)
    return step, _read_meta(os.path.join(directory, str(step)))


def restore_params(workdir: str, model, step: int | None = None) -> int:
    """Restore only the parameters of the latest complete checkpoint (or `step`) in place onto
    `model`, in the layout the model was built with, after checking their checksums. Returns
    the step restored. A damaged checkpoint raises CorruptCheckpointError naming it and the
    other steps there are."""
    directory = checkpoint_dir(workdir)
    step = _resolve_step(directory, step)
    step_dir = os.path.join(directory, str(step))
    try:
        check_integrity(step_dir, EVAL_ITEMS)
    except CorruptCheckpointError as e:
        others = [s for s in complete_steps(directory, warn=False) if s != step]
        if not others:
            raise
        raise CorruptCheckpointError(f"{e}; choose another with --step (steps: {others})") from None
    restored = _restore(step_dir, "model", _params_args(model), getattr(model, "cfg", None))
    _put_back(model, trainable(model), restored["params"])
    return step
