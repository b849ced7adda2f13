"""A directory a command writes (an export), without ever destroying what is already there.

`check_out` refuses, in one line, an `--out` that

  - is a file;
  - is a training run's directory, or lies inside one where it would replace the run's own
    files (its checkpoints/, metrics.jsonl, run_info.json, ...); a new folder beside them,
    such as `<workdir>/hf`, is fine;
  - exists and is not empty (`--out=.` in a working directory included), unless
    `--overwrite` is given and everything in it was written by an earlier run of the same
    command, as its manifest (`MANIFEST`) lists. Anything else in it is the user's.

`publish` then makes the output appear whole: the command writes into a staging directory
beside `out` (`staging_dir`), and publish renames it into place; an earlier export it
replaces is renamed aside first and removed only once the new one is in place. A failure at
any point leaves the earlier export, or nothing, at `out`, never a half-written directory.
"""

from __future__ import annotations

import json
import os
import shutil

from nnx_zoo.checkpoint.workdir import (
    CHECKPOINT_SUBDIR,
    LOCK_FILE,
    METRICS_FILE,
    raise_everywhere,
)
from nnx_zoo.errors import UsageError
from nnx_zoo.runtime import storage

MANIFEST = ".zoo-output.json"
# A directory holding any of these is a training run's (train_main writes them).
RUN_MARKERS = (CHECKPOINT_SUBDIR, METRICS_FILE, "run_info.json", LOCK_FILE)
# What a run keeps in its directory besides the markers: an output must not land on them.
RUN_FILES = (*RUN_MARKERS, "eval.json", "lm_eval.json", "tensorboard", "profile", "loss_curve.png")
_STAGING_SUFFIX = ".zoo-staging"
_OLD_SUFFIX = ".zoo-replaced"


def _is_run_dir(path: str) -> bool:
    if storage.is_url(path):  # no directories: a run's prefix holds one of its markers
        return any(storage.exists(storage.join(path, m)) for m in RUN_MARKERS)
    return os.path.isdir(path) and any(os.path.exists(os.path.join(path, m)) for m in RUN_MARKERS)


def _enclosing_run(path: str) -> str | None:
    """The nearest directory at or above `path` that is a training run's, or None."""
    current = path
    while True:
        if _is_run_dir(current):
            return current
        parent = storage.dirname(current)
        if parent == current or parent.endswith(":/"):  # the root, or a bucket's top
            return None
        current = parent


def read_manifest(out: str) -> dict | None:
    """The manifest of an earlier output at `out`; None when there is none (or it is not
    one of ours)."""
    try:
        manifest = json.loads(storage.read_bytes(storage.join(out, MANIFEST)))
    except (OSError, ValueError):
        return None
    ok = isinstance(manifest, dict) and isinstance(manifest.get("files"), list)
    return manifest if ok else None


def _shown(names: list[str], limit: int = 4) -> str:
    more = f", ... ({len(names)} in all)" if len(names) > limit else ""
    return ", ".join(sorted(names)[:limit]) + more


def check_out(out: str, command: str, *, overwrite: bool, flag: str = "--out") -> None:
    """UsageError (one line, naming `out` and what would be valid) unless `command`'s output
    may be written at the absolute path `out` (module docstring)."""
    given = f"{flag}={out}"
    if storage.is_url(out):
        if storage.isfile(out):
            raise UsageError(
                f"{given} is an object, not a prefix; name a new prefix to write under "
                "(nothing is written over an object)"
            )
    elif os.path.lexists(out) and not os.path.isdir(out):
        raise UsageError(
            f"{given} is a file, not a directory; name a new directory to write into "
            "(nothing is written over a file)"
        )
    run = _enclosing_run(out)
    if run == out:
        raise UsageError(
            f"{given} is a training run's directory (it holds "
            f"{_shown([m for m in RUN_FILES if storage.exists(storage.join(out, m))])}), whose "
            f"files the output would replace; choose a new directory, e.g. {flag}="
            f"{storage.join(out, 'hf')}"
        )
    if run is not None:
        if storage.is_url(out):
            first = out[len(run) :].strip("/").split("/")[0]
        else:
            first = os.path.relpath(out, run).split(os.sep)[0]
        if first in RUN_FILES:
            raise UsageError(
                f"{given} lies inside the training run {run}, in its {first}, which the output "
                f"would replace or corrupt; choose a new directory, e.g. {flag}="
                f"{storage.join(run, 'hf')}"
            )
    entries = storage.listdir(out) if storage.is_url(out) or os.path.isdir(out) else []
    if not entries:
        return
    manifest = read_manifest(out)
    if not overwrite:
        earlier = f"an earlier {command} output" if manifest else "files"
        raise UsageError(
            f"{given} exists and holds {earlier} ({_shown(entries)}); choose a new directory"
            + (", or pass --overwrite to replace that output" if manifest else "")
        )
    if manifest is None or manifest.get("written_by") != command:
        raise UsageError(
            f"{given} holds files that no earlier {command} wrote ({_shown(entries)}); "
            "--overwrite replaces only an earlier output of this command; choose a new directory"
        )
    foreign = sorted(set(entries) - set(manifest["files"]) - {MANIFEST})
    if foreign:
        raise UsageError(
            f"{given} holds files the earlier {command} did not write ({_shown(foreign)}); "
            "--overwrite replaces only what it wrote; move them, or choose a new directory"
        )


def staging_dir(out: str, *, clear: bool) -> str:
    """The directory to write `out`'s content into, beside it (so `publish` is a rename on
    one filesystem); the writer creates it. Its name is the same on every process and is
    ours alone: `clear` (the writing process) removes one left by an interrupted export.
    For an object-store `out`, a new local directory (`publish` uploads it)."""
    if storage.is_url(out):
        import tempfile

        path = tempfile.mkdtemp(prefix="nnx-zoo-output-")
        os.rmdir(path)  # the writer creates it, as beside a local `out`
        return path
    path = os.path.join(os.path.dirname(out), f".{os.path.basename(out)}{_STAGING_SUFFIX}")
    if clear:
        shutil.rmtree(path, ignore_errors=True)
    return path


def check_out_everywhere(out: str, command: str, *, overwrite: bool, flag: str = "--out"):
    """`check_out` on process 0 (the writer); UsageError on every process if it fails, so no
    process waits in a collective the others never reach."""
    import jax

    error = ""
    if jax.process_index() == 0:
        try:
            check_out(out, command, overwrite=overwrite, flag=flag)
        except ValueError as e:
            error = str(e)
    raise_everywhere(error, f"process 0 cannot write {flag}={out} (see its error)")


def publish(staging: str, out: str, command: str, **record) -> None:
    """Write the manifest (the staged entries, `command`, `record`) into `staging`, then put
    it at `out`: renamed into place, over an empty directory or an earlier output of
    `command` (`check_out` allowed), which is removed once the new one is there."""
    files = sorted(os.listdir(staging))
    manifest = {"written_by": command, **record, "files": files}
    with open(os.path.join(staging, MANIFEST), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2)
        f.write("\n")
    if storage.is_url(out):
        _publish_url(staging, out, files)
        return
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(staging, 0o777 & ~umask)  # as a directory made with the caller's umask
    if not os.path.isdir(out) or not os.listdir(out):
        os.replace(staging, out)  # replaces an empty directory in one step
        return
    old = os.path.join(os.path.dirname(out), f".{os.path.basename(out)}{_OLD_SUFFIX}")
    shutil.rmtree(old, ignore_errors=True)
    os.rename(out, old)
    os.rename(staging, out)
    shutil.rmtree(old)


def _publish_url(staging: str, out: str, files: list[str]) -> None:
    """An object store has no rename: the earlier output's manifest goes first (from then on
    `out` is not taken for a whole output), then the new files are uploaded, the earlier
    output's other files deleted, and the manifest uploaded last: `out` holds a complete
    output exactly when it holds a manifest."""
    earlier = read_manifest(out)
    if earlier is not None:
        storage.remove(storage.join(out, MANIFEST))
    storage.upload_tree(staging, out, last=(MANIFEST,))
    for name in set((earlier or {}).get("files", [])) - set(files):
        storage.rmtree(storage.join(out, name))
    shutil.rmtree(staging, ignore_errors=True)
