"""Files that a crash never leaves half-written."""

from __future__ import annotations

import io
import json
import os
import tempfile

from nnx_zoo.runtime import storage


def _umask() -> int:
    try:  # Linux shows it without changing it
        with open("/proc/self/status") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        # Elsewhere reading it means setting it (briefly; done once, at import).
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


# mkstemp creates files 0600; the files a run writes get the modes open() would give them.
_FILE_MODE = 0o666 & ~_umask()


def atomic_write(path: str, write) -> None:
    """Call `write(file_object)` on a temporary file beside `path`, fsync, then rename over it,
    so a reader or a crash sees either the old file or the complete new one. An object-store
    URL (`gs://`, `s3://`) is written whole in one request, which gives the same guarantee
    (nnx_zoo/runtime/storage.py)."""
    if storage.is_url(path):
        buffer = io.BytesIO()
        write(buffer)
        storage.write_bytes(path, buffer.getvalue())
        return
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        os.fchmod(fd, _FILE_MODE)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def write_json_atomic(path: str, record) -> None:
    atomic_write(path, lambda f: f.write((json.dumps(record, indent=2) + "\n").encode()))
