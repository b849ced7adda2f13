"""Files that a crash never leaves half-written."""

from __future__ import annotations

import json
import os
import tempfile


def atomic_write(path: str, write) -> None:
    """Call `write(file_object)` on a temporary file beside `path`, fsync, then rename over it,
    so a reader or a crash sees either the old file or the complete new one."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=os.path.basename(path))
    try:
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
