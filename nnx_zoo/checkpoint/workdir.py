"""The run directory: check that it can be written before any work starts, and hold it
exclusively for the life of a training run.

The lock is `flock` on `<workdir>/.lock`, which names its holder (pid, host, start time). The
kernel drops it when the holder exits, however it exits, so a lock file whose lock is free
was left by a run that died: the next run takes it over and says whose it was. Linux NFS
clients implement flock with POSIX byte-range locks, so the lock also holds across hosts on a
shared filesystem. With several processes, process 0 takes it (`hold`). On an object store
(`gs://`, `s3://`) there is no flock: the lock is a conditional create with an expiry that
its holder renews (nnx_zoo/checkpoint/object_lock.py), and the checks here write through
nnx_zoo/runtime/storage.py.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import os
import socket
import tempfile
import time

from nnx_zoo.checkpoint.object_lock import ObjectStoreLock
from nnx_zoo.errors import UsageError
from nnx_zoo.runtime import storage
from nnx_zoo.runtime.console import warn

LOCK_FILE = ".lock"


def expand(path: str) -> str:
    """`~` expanded, absolute: every entry point reads a --workdir the same way. A `gs://` or
    `s3://` URL is kept as a URL (tidied: no trailing or doubled slashes); the run's own
    files then go through nnx_zoo/runtime/storage.py and its lock is
    nnx_zoo/checkpoint/object_lock.py's. Any other scheme is refused in one line rather than
    taken for a relative path (it would quietly become ./hdfs:/...).
    """
    if storage.is_url(path):
        url = storage.normalize(path)
        if not url.split("://", 1)[1]:
            raise UsageError(f"{path}: name a bucket, e.g. {path.rstrip('/')}/my-bucket/run")
        return url
    if "://" in path:
        raise UsageError(
            f"{path}: the only URLs a run directory may be are gs://BUCKET/... and "
            "s3://BUCKET/...; for another store, mount it and pass the mounted path"
        )
    return os.path.abspath(os.path.expanduser(path))


def check_writable(workdir: str, flag: str = "--workdir", *, keep: bool = True) -> None:
    """Create `workdir` if needed and write a file in it; UsageError (one line) if either
    fails, or if the path is a file. `keep=False`: a directory this call created is removed
    again (a run refused later leaves no empty folder behind)."""
    # A flag reads `--workdir=DIR`; a description reads `the checkpoint directory DIR`.
    name = f"{flag}={workdir}" if flag.startswith("--") else f"{flag} {workdir}"
    if storage.is_url(workdir):
        storage.check_writable(workdir)
        return
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise UsageError(f"{name} is a file, not a directory")
    created = not os.path.exists(workdir)
    try:
        os.makedirs(workdir, exist_ok=True)
        # A real write: permission bits do not tell root about read-only mounts.
        with tempfile.NamedTemporaryFile(dir=workdir, prefix=".write-test-"):
            pass
        if created and not keep:
            os.rmdir(workdir)
    except OSError as e:
        reason = e.strerror or errno.errorcode.get(e.errno, str(e))
        raise UsageError(f"{name} cannot be written ({reason})") from None


class WorkdirLock:
    """An exclusive lock on a run directory; `release()` (also at exit) frees it."""

    def __init__(self, workdir: str):
        self.path = os.path.join(workdir, LOCK_FILE)
        self._fd: int | None = None

    def acquire(self) -> str | None:
        """Take the lock. Raises UsageError naming the holder if another live process has
        it; returns a warning line when it took over a dead run's lock, else None."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _read(fd) or "another process"
            os.close(fd)
            if e.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise UsageError(
                    f"workdir {os.path.dirname(self.path)} is in use by {holder}; wait for "
                    "that run to end, or choose another --workdir"
                ) from None
            raise
        previous = _read(fd)
        os.ftruncate(fd, 0)
        me = f"pid {os.getpid()} on host {socket.gethostname()} (since {time.strftime('%c')})"
        os.pwrite(fd, me.encode(), 0)
        os.fsync(fd)
        self._fd = fd
        atexit.register(self.release)
        if previous:
            return f"took over the stale lock of {previous}, which is no longer running"
        return None

    def release(self) -> None:
        if self._fd is None:
            return
        os.ftruncate(self._fd, 0)  # an empty file: nobody held it when it was released
        os.close(self._fd)  # closing drops the flock
        self._fd = None


def _read(fd: int) -> str:
    return os.pread(fd, 4096, 0).decode("utf-8", errors="replace").strip()


# Written by a training run: a workdir holding either has a history worth keeping.
CHECKPOINT_SUBDIR = "checkpoints"
METRICS_FILE = "metrics.jsonl"


def check_history(workdir: str, checkpoints: bool) -> None:
    """UsageError (one line) when a run without checkpoints would start a workdir that holds
    an earlier run's records: it could not resume them, and starting from step 0 would cut
    metrics.jsonl and overwrite run_info.json while the old checkpoints stayed, so records
    and checkpoints would disagree."""
    if checkpoints:
        return
    ckpt_dir = storage.join(workdir, CHECKPOINT_SUBDIR)
    saved = sorted(n for n in storage.listdir(ckpt_dir) if n.isdigit())
    metrics = storage.join(workdir, METRICS_FILE)
    if saved or (storage.isfile(metrics) and storage.size(metrics) > 0):
        what = f"checkpoint steps {', '.join(saved)}" if saved else METRICS_FILE
        raise UsageError(
            f"--workdir={workdir} holds an earlier run ({what}) and "
            "--config.checkpoint.enabled=False would start over and overwrite its records; "
            "choose a new --workdir, or leave checkpoints enabled to resume it"
        )


def hold(workdir: str, *, checkpoints: bool = True) -> WorkdirLock | None:
    """Check that the workdir (and, with `checkpoints`, its checkpoints/ folder) can be
    written, that it holds no history a run without checkpoints would overwrite
    (`check_history`), and take its lock, on process 0; tell every process the outcome:
    UsageError on all of them if any check fails. Returns the lock on process 0."""
    import jax

    lock, error = None, ""
    if jax.process_index() == 0:
        try:
            check_writable(workdir)
            if checkpoints and not storage.is_url(workdir):  # the same bucket: one probe
                # Orbax would find out at the first save, after training, by a timeout.
                check_writable(
                    os.path.join(workdir, CHECKPOINT_SUBDIR), "the checkpoint directory", keep=False
                )
            check_history(workdir, checkpoints)
            lock = (
                ObjectStoreLock(workdir, LOCK_FILE)
                if storage.is_url(workdir)
                else WorkdirLock(workdir)
            )
            warning = lock.acquire()
        except ValueError as e:
            lock, error = None, str(e)
        except OSError as e:  # e.g. a full disk: the lock file cannot record its holder
            lock, error = None, f"--workdir={workdir}: cannot take its lock ({e.strerror or e})"
        else:
            if warning:
                warn(warning)
    raise_everywhere(error, f"process 0 could not take the workdir {workdir} (see its error)")
    return lock


def check_writable_everywhere(workdir: str, flag: str = "--workdir") -> None:
    """`check_writable` on process 0; UsageError on every process if it fails."""
    import jax

    error = ""
    if jax.process_index() == 0:
        try:
            check_writable(workdir, flag)
        except ValueError as e:
            error = str(e)
    raise_everywhere(error, f"process 0 cannot write {flag}={workdir} (see its error)")


def raise_everywhere(error: str, elsewhere: str) -> None:
    """Raise UsageError(error) on process 0 and UsageError(elsewhere) on the others when
    process 0 had an error, so no process waits for a collective the others never reach."""
    import jax

    if jax.process_count() > 1:
        import numpy as np
        from jax.experimental import multihost_utils

        failed = multihost_utils.broadcast_one_to_all(np.int32(bool(error)))
        if int(failed) and not error:
            error = elsewhere
    if error:
        raise UsageError(error)
