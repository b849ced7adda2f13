"""A save that cannot be written: one line, the run stops, the last good checkpoint stays.

What happens on a full disk (ENOSPC), a quota (EDQUOT), an I/O error (EIO) or a directory
that went away while a save was being written (the policy, documented in the README):

- Before each save, the free space of a local checkpoint directory is compared with the
  size of the last save (its manifest), or of the arrays before the first: a save that will
  not fit is never started, and the run stops with the one line below and nothing else.
  A write that fails anyway (a quota statvfs does not show, another writer, too few
  inodes, EIO) stops the run the same way, when the background write's error reaches the
  training thread (the next save, or the end of the run).
- The run stops with exit status 1 and one line naming the step that could not be saved, the
  reason, and the newest complete checkpoint (which a run with the same --workdir resumes).
  Not a warning and a retry at the next interval: a full disk seldom frees itself, and
  training on without saves only grows the work a later crash would lose.
- A partial save is never taken as a checkpoint: Orbax writes into `<step>.orbax-checkpoint-
  tmp` and renames it to `<step>` only when complete, and a step counts only once its
  checksums.json is written after that (nnx_zoo/checkpoint/manager.py). The leftover temporary
  directory is removed when the next run starts (Orbax's cleanup_tmp_directories).
- Every earlier checkpoint is left as it was: nothing is deleted before a new save commits.

TensorStore reports a full disk as `RESOURCE_EXHAUSTED` inside a ValueError, Python as
OSError(errno 28): `reason` finds either anywhere in the exception chain.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import sys
import traceback

from nnx_zoo.runtime.console import one_line

# What Orbax and TensorStore print around a failed save, besides the one line: each is kept
# off stderr by `failed_saves_said_once()` while a run is in it (and only then), and each
# names a failure that is raised again, or one that already was.
#
# Orbax's background writes are asyncio tasks: when they fail, the event loop logs "exception
# was never retrieved" with a stack trace for every array. The failure is reported once, by
# CheckpointWriteError; the per-array copies are noise.
_STORAGE_FRAME = re.compile(r"[/\\](orbax|tensorstore)[/\\]")


def _not_a_failed_write(record: logging.LogRecord) -> bool:
    error = record.exc_info[1] if record.exc_info else None
    if error is None or "exception was never retrieved" not in record.getMessage():
        return True
    frames = traceback.extract_tb(error.__traceback__)
    return not any(_STORAGE_FRAME.search(frame.filename) for frame in frames)


# Orbax's background threads also log each failure with its stack trace (absl, ERROR; ~600
# lines for one full disk at the tiny model) before storing it, and `wait_until_finished`
# raises the stored error in the caller, where it becomes the one line. Only these messages
# are dropped: each names an exception that is raised again.
_RERAISED = re.compile(
    r"_SignalingThread\.run\(\) raised an exception"
    r"|Failed to run \d+ Handler Commit operations"
    r"|Save Finalize thread \(\w+\) failed"
)


def _not_reraised(record: logging.LogRecord) -> bool:
    return not (
        record.levelno >= logging.ERROR
        and "orbax" in record.pathname
        and _RERAISED.search(record.getMessage())
    )


# After a failed save Orbax closes its event loop while TensorStore writes are still pending;
# each one that completes then tries to wake the closed loop and TensorStore reports it as an
# unraisable "Event loop is closed" (~100 lines on stderr, timing-dependent, between the
# failure and the one line). Nothing is lost with them: the save already failed and says so.
def _closed_loop_wakeup(unraisable) -> bool:
    error = unraisable.exc_value
    frames = traceback.extract_tb(unraisable.exc_traceback)
    return (
        isinstance(error, RuntimeError)
        and str(error) == "Event loop is closed"
        and bool(frames)
        and frames[-1].filename.endswith(os.path.join("asyncio", "base_events.py"))
    )


@contextlib.contextmanager
def failed_saves_said_once():
    """For the length of a run that saves checkpoints (train_main's): what Orbax, asyncio and
    TensorStore print around a failed save is kept off stderr, since the run reports the
    failure in one line (CheckpointWriteError). Everything else they log, and every other
    unraisable error, passes as before; all is put back when the block ends."""
    asyncio_log, absl_log = logging.getLogger("asyncio"), logging.getLogger("absl")
    previous = sys.unraisablehook

    def hook(unraisable) -> None:
        if not _closed_loop_wakeup(unraisable):
            previous(unraisable)

    asyncio_log.addFilter(_not_a_failed_write)
    absl_log.addFilter(_not_reraised)
    sys.unraisablehook = hook
    try:
        yield
    finally:
        asyncio_log.removeFilter(_not_a_failed_write)
        absl_log.removeFilter(_not_reraised)
        if sys.unraisablehook is hook:  # a hook installed since is the installer's to undo
            sys.unraisablehook = previous


_REASONS = (
    (re.compile(r"RESOURCE_EXHAUSTED|No space left", re.I), os.strerror(errno.ENOSPC)),
    (re.compile(r"quota", re.I), os.strerror(errno.EDQUOT)),
    (re.compile(r"Input/output error", re.I), os.strerror(errno.EIO)),
    (re.compile(r"Read-only file system", re.I), os.strerror(errno.EROFS)),
    (re.compile(r"No such file or directory|NOT_FOUND", re.I), "its directory is gone"),
)


class CheckpointWriteError(RuntimeError):
    """A save failed while being written; the message is one line (see the module doc)."""

    def __init__(
        self, step: int, reason: str, last_good: int | None, directory: str, kept: str = ""
    ):
        self.step, self.reason, self.last_good = step, reason, last_good
        kept = kept or (
            f"the last complete checkpoint is step {last_good}"
            if last_good is not None
            else "no checkpoint was completed"
        )
        super().__init__(
            f"checkpoint step {step} could not be written to {directory} ({reason}); {kept}; "
            "make room (or restore the directory) and run again with the same --workdir"
        )


def reason(error: BaseException) -> str:
    """A short cause for `error`: the errno text of the first OSError in its chain, a known
    storage failure in its text, else its first line."""
    seen, chain = set(), []
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        chain.append(e)
        e = e.__cause__ or e.__context__
    for e in chain:
        if isinstance(e, OSError) and e.errno:
            return e.strerror or os.strerror(e.errno)
    text = " ".join(str(e) for e in chain)
    for pattern, name in _REASONS:
        if pattern.search(text):
            return name
    return f"{type(error).__name__}: {one_line(error)[:200]}"


# Room kept beyond the estimate: Orbax's metadata files, the manifest, filesystem blocks.
SPACE_MARGIN = 1.1


def lacks_space(directory: str, needed: int) -> str | None:
    """Why a save of `needed` bytes would not fit in `directory`'s filesystem, or None.
    `directory` is a local or mounted path (nnx_zoo/checkpoint/workdir.py refuses object-store
    URLs).
    The check is a forecast of bytes: a quota statvfs does not see, too few inodes, or
    another writer filling the disk meanwhile, still fails the write (then: `reason`)."""
    path = directory
    while not os.path.isdir(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        stats = os.statvfs(path)
    except OSError:
        return None
    free = stats.f_bavail * stats.f_frsize
    if free >= needed * SPACE_MARGIN:
        return None
    return (
        f"{os.strerror(errno.ENOSPC)}: a save needs about {needed / 2**20:.1f} MiB, "
        f"{free / 2**20:.1f} MiB are free"
    )


def find(error: BaseException | None) -> CheckpointWriteError | None:
    """The first CheckpointWriteError raised in `error`'s chain (a cleanup that failed on the
    same full disk may have raised over it, or again), or None."""
    found, seen = None, set()
    while error is not None and id(error) not in seen:
        if isinstance(error, CheckpointWriteError):
            found = error  # keep walking: the earliest one names the step that failed
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return found
