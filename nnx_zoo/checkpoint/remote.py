"""Where Orbax can write a checkpoint directory itself, and a local copy where it cannot.

Orbax (0.12.8, the newest) writes arrays through TensorStore specs it builds from the path:
`gs://` becomes TensorStore's GCS driver, anything else must be an absolute local path
(`orbax/checkpoint/_src/serialization/tensorstore_utils.py`, `_build_ocdbt_kvstore_tspec`), so
an `s3://` path fails there ("Checkpoint path should be absolute"). For `s3://` a step is
therefore written by Orbax into a local staging directory and uploaded once committed, its
`checksums.json` last (`upload_step`); reading one downloads it first (`readable`). `gs://`
and local paths are Orbax's own, read and written in place.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

from nnx_zoo.runtime import storage

_DOWNLOADS: dict[str, str] = {}


def orbax_writes(directory: str) -> bool:
    """Whether Orbax reads and writes `directory` itself."""
    return not directory.startswith("s3://")


def staging_dir(prefix: str) -> str:
    """A new local directory (under $TMPDIR) removed at exit."""
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, True)
    return path


def upload_step(local_step: str, remote_step: str, manifest: str) -> None:
    """Copy a committed step and its manifest (last: its presence means the copy is whole)."""
    storage.rmtree(remote_step)  # a copy cut short by an earlier crash
    storage.upload_tree(local_step, remote_step, last=(manifest,))


def readable(step_dir: str) -> str:
    """A path Orbax can read `step_dir` from: itself, or (s3://) a local copy made once per
    process."""
    if orbax_writes(step_dir):
        return step_dir
    local = _DOWNLOADS.get(step_dir)
    if local is None or not os.path.isdir(local):
        local = os.path.join(staging_dir("nnx-zoo-restore-"), storage.basename(step_dir))
        storage.download_tree(step_dir, local)
        _DOWNLOADS[step_dir] = local
    return local
