"""Reading a checkpoint back: every tree item shape-checked against its live target before
any array is read, then read straight into the target's layout (any strategy, any device
count, a vocabulary padded for another mesh); the meta alone; or the parameters alone
(evaluation). The step directories and their checks are nnx_zoo/checkpoint/steps.py's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from flax import nnx
from jax.sharding import AbstractMesh, NamedSharding

from nnx_zoo.checkpoint import remote
from nnx_zoo.checkpoint.steps import (
    EVAL_ITEMS,
    LEGACY_DATA,
    CorruptCheckpointError,
    check_integrity,
    checkpoint_dir,
    complete_steps,
    resolve_step,
)
from nnx_zoo.errors import UsageError
from nnx_zoo.runtime import storage
from nnx_zoo.runtime.console import one_line
from zoo import VOCAB_DIMS

# What `params` holds: every nnx.Param, or for a LoRA run only its adapters (the frozen base
# is the run's --init_from directory, which run_info.json names).
from zoo.layers.lora import trainable

_TREE_ITEMS = ("params", "opt_state")


def handlers() -> dict[str, Any]:
    return {
        "params": ocp.StandardCheckpointHandler(),
        "opt_state": ocp.StandardCheckpointHandler(),
        "data_position": ocp.JsonCheckpointHandler(),
        LEGACY_DATA: grain.checkpoint.CheckpointHandler(),
        "meta": ocp.JsonCheckpointHandler(),
    }


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


def restore_targets(tree):
    """Restore targets: each array's shape, dtype and sharding (the model's layout). Leaves
    may be live arrays or the ShapeDtypeStructs of an `nnx.eval_shape` model, whose shardings
    name the abstract mesh; those are bound to the active concrete mesh (`jax.set_mesh`)."""

    def target(x):
        sharding = x.sharding
        if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, AbstractMesh):
            mesh = jax.sharding.get_mesh()
            if mesh is None or mesh.empty:
                raise UsageError("restoring onto an abstract model needs `with jax.set_mesh(mesh)`")
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
    """One-line UsageError naming every array whose saved shape or dtype differs, or that only
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
        raise UsageError(f"checkpoint does not fit the {what}: " + "; ".join(diffs))
    return resized


def params_tree(model) -> dict:
    return nnx.to_pure_dict(nnx.state(model, trainable(model)))


def opt_state_tree(optimizer) -> dict:
    return nnx.to_pure_dict(nnx.state(optimizer, nnx.optimizer.OptState))


def _params_args(model) -> dict[str, Any]:
    """Orbax restore arguments for the parameters, in the live model's layout."""
    return {"params": ocp.args.StandardRestore(restore_targets(params_tree(model)))}


def _unreadable(step_dir: str, error: BaseException, what: str = "") -> CorruptCheckpointError:
    reason = f"{type(error).__name__}: {one_line(error)}"[:300]
    return CorruptCheckpointError(f"checkpoint {step_dir} {what}cannot be read ({reason})")


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
    source = remote.readable(step_dir)
    checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler(**handlers()))
    try:
        try:
            metadata = checkpointer.metadata(source).item_metadata
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
            return checkpointer.restore(source, args=ocp.args.Composite(**args))
        except Exception as e:  # noqa: BLE001 -- tensorstore/OCDBT errors past the checksums
            raise _unreadable(step_dir, e) from e
    finally:
        checkpointer.close()


def restore_step(step_dir: str, *, model, optimizer=None, data_iter=None) -> dict:
    """Restore `step_dir` in place onto the live model / optimizer / iterator (their current
    shardings, whatever mesh wrote the checkpoint), its checksums checked by the caller.
    Returns the saved meta dict."""
    args = _params_args(model)
    if optimizer is not None:
        args["opt_state"] = ocp.args.StandardRestore(restore_targets(opt_state_tree(optimizer)))
    legacy_data = None
    if data_iter is not None:
        if storage.isdir(storage.join(step_dir, "data_position")):
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


def _legacy_data_state(step_dir: str) -> dict:
    """The data position of a checkpoint written before positions were global: Grain's
    per-process files `process_<i>-of-<n>.json`. A one-process run's state is a state of the
    global stream (its pipeline saw every document); with n > 1 each file is a position in
    that process's own share of the documents, which no longer exists."""
    data_dir = storage.join(step_dir, LEGACY_DATA)
    names = storage.listdir(data_dir)
    saved = sorted(n for n in names if n.startswith("process_") and n.endswith(".json"))
    if not saved:
        raise CorruptCheckpointError(f"checkpoint {step_dir} holds no data position")
    if saved != ["process_0-of-1.json"]:
        raise UsageError(
            f"checkpoint {step_dir} keeps one data position per process ({', '.join(saved)}), "
            "in streams split by process, which this version no longer has: resume it with the "
            "version that wrote it, or change a data field (e.g. --config.data.shuffle_seed) "
            "to restart the data stream, keeping the model and optimizer"
        )
    return json.loads(storage.read_bytes(storage.join(data_dir, saved[0])))


def _read_meta(step_dir: str) -> dict:
    checkpointer = ocp.Checkpointer(
        ocp.CompositeCheckpointHandler(meta=ocp.JsonCheckpointHandler())
    )
    try:
        restored = checkpointer.restore(
            remote.readable(step_dir), args=ocp.args.Composite(meta=ocp.args.JsonRestore())
        )
    except Exception as e:  # noqa: BLE001 -- any failure to read it means a damaged dir
        raise _unreadable(step_dir, e, "meta ") from e
    finally:
        checkpointer.close()
    return dict(restored["meta"])


def read_meta(workdir: str, step: int | None = None) -> tuple[int, dict]:
    """(step, meta) of the latest complete checkpoint (or `step`) without reading arrays."""
    directory = checkpoint_dir(workdir)
    step = resolve_step(directory, step)
    return step, _read_meta(storage.join(directory, str(step)))


def restore_params(workdir: str, model, step: int | None = None) -> int:
    """Restore only the parameters of the latest complete checkpoint (or `step`) in place onto
    `model`, in the layout the model was built with, after checking their checksums. Returns
    the step restored. A damaged checkpoint raises CorruptCheckpointError naming it and the
    other steps there are."""
    directory = checkpoint_dir(workdir)
    step = resolve_step(directory, step)
    step_dir = storage.join(directory, str(step))
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
