"""Orbax checkpoints of a training run: save asynchronously, resume exactly, restore anywhere.

Layout: `<workdir>/checkpoints/<step>/` with four Orbax items,

  params     nnx.state(model, nnx.Param) as a pure dict of arrays (OCDBT, sharded writes)
  opt_state  nnx.state(optimizer, nnx.optimizer.OptState): the step count and optax's state
  data       the Grain iterator's state, one JSON file per process (grain.checkpoint)
  meta       JSON: {'step', 'run_info' (config, strategy, mesh), and what the loop adds
             (e.g. the RNG seed/counter)}

The model and the optimizer are separate items so evaluation restores the parameters alone
(Orbax's StandardRestore of part of one saved tree fails on the structure mismatch).

Restoring onto any strategy and device count: the targets are built from the *live* model's
arrays (shape, dtype, sharding), so Orbax reads each shard straight into the layout the model
was built with, whatever mesh the checkpoint was written from; then `nnx.update`.

Policy for unfinished checkpoints. Orbax writes a step into `<step>.orbax-checkpoint-tmp-*`
and renames it when complete, so a save cut short by a crash never carries a step name (and
`cleanup_tmp_directories` removes the leftovers). A step directory can still be damaged
afterwards (a copy or sync cut short, files deleted); `step_dir_problem` checks the files
Orbax writes last for every item (commit markers, tree metadata, OCDBT manifests, the meta
JSON). Such a step is never the latest: readers skip it with a warning and fall back to the
newest complete one; a `Checkpointer` (the training side) also moves it to
`checkpoints/invalid/` so the resumed run can save that step number again. Damage that only
shows when the arrays are read (a truncated data file) fails the restore with one line.

Errors are one line: FileNotFoundError when the workdir holds no complete checkpoint,
ValueError for a corrupt or partial one and for one whose arrays do not fit the model (the
saved and the model's shapes are compared before anything is read, naming every array that
differs).
"""

from __future__ import annotations

import json
import os
import shutil
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

CHECKPOINT_SUBDIR = "checkpoints"
INVALID_SUBDIR = "invalid"
ITEMS = ("params", "opt_state", "data", "meta")
_TREE_ITEMS = ("params", "opt_state")
# Files Orbax writes last for a step (in the temporary directory, before the rename).
_STEP_FILES = ("_CHECKPOINT_METADATA",)
_TREE_FILES = ("_METADATA", "manifest.ocdbt", "commit_success.txt")


def checkpoint_dir(workdir: str) -> str:
    return os.path.join(os.path.abspath(os.path.expanduser(workdir)), CHECKPOINT_SUBDIR)


def _handlers() -> dict[str, Any]:
    return {
        "params": ocp.StandardCheckpointHandler(),
        "opt_state": ocp.StandardCheckpointHandler(),
        "data": grain.checkpoint.CheckpointHandler(),
        "meta": ocp.JsonCheckpointHandler(),
    }


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


# ----------------------------------------------------------------------------- step dirs


def _step_names(directory: str) -> list[int]:
    """Finished step directories (plain integers; Orbax's temporary ones carry a suffix)."""
    if not os.path.isdir(directory):
        return []
    return sorted(int(n) for n in os.listdir(directory) if n.isdigit())


def step_dir_problem(step_dir: str, items=ITEMS) -> str | None:
    """Why `step_dir` is not a complete checkpoint of `items`, or None when it is."""
    for name in _STEP_FILES:
        if not os.path.isfile(os.path.join(step_dir, name)):
            return f"missing {name}"
    for item in items:
        item_dir = os.path.join(step_dir, item)
        if not os.path.isdir(item_dir):
            return f"missing item {item!r}"
        if item in _TREE_ITEMS:
            for name in _TREE_FILES:
                if not os.path.isfile(os.path.join(item_dir, name)):
                    return f"missing {item}/{name}"
        elif item == "meta":
            try:
                with open(os.path.join(item_dir, "metadata")) as f:
                    json.load(f)
            except (OSError, ValueError) as e:
                return f"unreadable meta ({_one_line(e)})"
        elif item == "data" and not any(n.endswith(".json") for n in os.listdir(item_dir)):
            return "missing the data iterator state"
    return None


def complete_steps(directory: str, items=ITEMS, *, warn: bool = True) -> list[int]:
    """Steps under `directory` that are complete checkpoints, oldest first."""
    steps = []
    for step in _step_names(directory):
        problem = step_dir_problem(os.path.join(directory, str(step)), items)
        if problem is None:
            steps.append(step)
        elif warn:
            logging.warning("skipping incomplete checkpoint %s/%d: %s", directory, step, problem)
    return steps


def _resolve_step(directory: str, step: int | None, items) -> int:
    if step is None:
        steps = complete_steps(directory, items)
        if not steps:
            found = _step_names(directory)
            detail = f" ({len(found)} incomplete step dirs)" if found else ""
            raise FileNotFoundError(f"no complete checkpoint in {directory}{detail}")
        return steps[-1]
    step_dir = os.path.join(directory, str(step))
    if not os.path.isdir(step_dir):
        have = _step_names(directory)
        raise FileNotFoundError(f"no checkpoint for step {step} in {directory} (steps: {have})")
    problem = step_dir_problem(step_dir, items)
    if problem:
        raise ValueError(f"checkpoint {step_dir} is corrupt or partial: {problem}")
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


def check_fits(saved_tree: Mapping, live_tree: Mapping, what: str) -> None:
    """One-line ValueError naming every array whose saved shape or dtype differs, or that only
    one side has."""
    saved, live = _flatten(saved_tree), _flatten(live_tree)
    diffs = []
    for path in sorted(saved.keys() | live.keys()):
        if path not in live:
            diffs.append(f"{path} saved {tuple(saved[path].shape)} but not in the model")
        elif path not in saved:
            diffs.append(f"{path} missing from the checkpoint (model {tuple(live[path].shape)})")
        else:
            s, m = saved[path], live[path]
            if tuple(s.shape) != tuple(m.shape):
                diffs.append(f"{path} saved {tuple(s.shape)} vs model {tuple(m.shape)}")
            elif np.dtype(s.dtype) != np.dtype(m.dtype):
                diffs.append(f"{path} saved {np.dtype(s.dtype)} vs model {np.dtype(m.dtype)}")
    if diffs:
        raise ValueError(f"checkpoint does not fit the {what}: " + "; ".join(diffs))


def _params(model) -> dict:
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def _opt_state(optimizer) -> dict:
    return nnx.to_pure_dict(nnx.state(optimizer, nnx.optimizer.OptState))


def _put_back(module, var_filter, restored: dict) -> None:
    state = nnx.state(module, var_filter)
    nnx.replace_by_pure_dict(state, restored)
    nnx.update(module, state)


def _restore(step_dir: str, what: str, args: dict[str, Any]) -> dict:
    """Read `args`' items from `step_dir`, shape-checking the tree items against their
    targets before any array is read."""
    checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler(**_handlers()))
    try:
        try:
            metadata = checkpointer.metadata(step_dir).item_metadata
        except Exception as e:  # noqa: BLE001 -- any failure to read it means a damaged dir
            raise ValueError(f"checkpoint {step_dir} is corrupt or partial ({_one_line(e)})") from e
        for item in _TREE_ITEMS:
            if item in args:
                saved = getattr(metadata.get(item), "tree", None)
                if saved is None:
                    raise ValueError(f"checkpoint {step_dir} is corrupt or partial: no {item} tree")
                check_fits(saved, args[item].item, what if item == "params" else "optimizer")
        try:
            return checkpointer.restore(step_dir, args=ocp.args.Composite(**args))
        except Exception as e:  # noqa: BLE001 -- tensorstore/OCDBT read errors: damaged files
            raise ValueError(
                f"checkpoint {step_dir} is corrupt or partial ({_one_line(e)}); remove it to "
                "fall back to the previous one"
            ) from e
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
        self._set_aside_incomplete()
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep,
                enable_async_checkpointing=async_save,
                cleanup_tmp_directories=True,  # leftovers of a save cut short
            ),
            item_handlers=_handlers(),
        )

    def _set_aside_incomplete(self) -> None:
        """Move damaged step dirs to checkpoints/invalid/ (process 0; the others wait), so
        they are never resumed from and their step can be saved again."""
        if jax.process_index() == 0:
            for step in _step_names(self.directory):
                step_dir = os.path.join(self.directory, str(step))
                problem = step_dir_problem(step_dir)
                if problem:
                    target = os.path.join(
                        self.directory, INVALID_SUBDIR, f"{step}-{time.strftime('%Y%m%d-%H%M%S')}"
                    )
                    os.makedirs(os.path.dirname(target), exist_ok=True)
                    shutil.move(step_dir, target)
                    logging.warning(
                        "checkpoint %s is incomplete (%s); moved to %s", step_dir, problem, target
                    )
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("checkpoint: set aside incomplete steps")

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step (a save still being written does not count)."""
        steps = complete_steps(self.directory)
        return steps[-1] if steps else None

    def restore(self, step: int, *, model, optimizer=None, data_iter=None) -> dict:
        """Restore `step` in place onto the live model / optimizer / iterator (their current
        shardings, whatever mesh wrote the checkpoint). Returns the saved meta dict."""
        step = _resolve_step(self.directory, step, ITEMS)
        step_dir = os.path.join(self.directory, str(step))
        args = {"params": ocp.args.StandardRestore(_abstract(_params(model)))}
        if optimizer is not None:
            args["opt_state"] = ocp.args.StandardRestore(_abstract(_opt_state(optimizer)))
        if data_iter is not None:
            _check_data_state(step_dir)
            args["data"] = grain.checkpoint.CheckpointRestore(data_iter)
        args["meta"] = ocp.args.JsonRestore()
        restored = _restore(step_dir, "model", args)
        _put_back(model, nnx.Param, restored["params"])
        if optimizer is not None:
            _put_back(optimizer, nnx.optimizer.OptState, restored["opt_state"])
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
        memory (async) or written (sync); buffers may be donated right after."""
        step = int(step)
        if not force and step % self.save_every:
            return False
        if step in self._manager.all_steps():
            return False
        record = _to_json({**(meta or {}), "step": step, "run_info": self.run_info})
        args = ocp.args.Composite(
            params=ocp.args.StandardSave(_params(model)),
            opt_state=ocp.args.StandardSave(_opt_state(optimizer)),
            data=grain.checkpoint.CheckpointSave(data_iter),
            meta=ocp.args.JsonSave(record),
        )
        start = time.perf_counter()
        self._manager.save(step, args=args, force=True)
        self.last_save_blocking_s = time.perf_counter() - start
        return True

    def wait(self) -> None:
        """Block until every started save is on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


def _check_data_state(step_dir: str) -> None:
    name = f"process_{jax.process_index()}-of-{jax.process_count()}.json"
    data_dir = os.path.join(step_dir, "data")
    if not os.path.isfile(os.path.join(data_dir, name)):
        saved = sorted(os.listdir(data_dir)) if os.path.isdir(data_dir) else []
        raise ValueError(
            f"checkpoint {step_dir} has no data-iterator state for {name} (saved: {saved}); "
            "resume with the process count that wrote it"
        )


# ----------------------------------------------------------------------------- evaluation side


def read_meta(workdir: str, step: int | None = None) -> tuple[int, dict]:
    """(step, meta) of the latest complete checkpoint (or `step`) without reading arrays."""
    directory = checkpoint_dir(workdir)
    step = _resolve_step(directory, step, ITEMS)
    with open(os.path.join(directory, str(step), "meta", "metadata")) as f:
        return step, json.load(f)


def restore_params(workdir: str, model, step: int | None = None) -> int:
    """Restore only the parameters of the latest complete checkpoint (or `step`) in place onto
    `model`, in the layout the model was built with. Returns the step restored."""
    directory = checkpoint_dir(workdir)
    step = _resolve_step(directory, step, ("params", "meta"))
    step_dir = os.path.join(directory, str(step))
    args = {"params": ocp.args.StandardRestore(_abstract(_params(model)))}
    restored = _restore(step_dir, "model", args)
    _put_back(model, nnx.Param, restored["params"])
    return step
