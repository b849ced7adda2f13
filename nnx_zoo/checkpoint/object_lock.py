"""The workdir lock on an object store (`gs://`, `s3://`), where there is no flock and no
kernel to drop a dead holder's lock.

The lock is a numbered series of objects `<workdir>/.lock/<n>`; the holder is whoever created
the highest number. Taking it is a conditional create of the next number (GCS
`ifGenerationMatch=0`, S3 `If-None-Match: *`): of two runs racing for the same number the
store lets exactly one write it. The holder renews (rewrites) its object every third of the
expiry (`NNX_ZOO_LOCK_TTL_S`, default 300 s); a run finding the newest object older than its
expiry (by the object's time of last write, the store's clock, against this host's) takes the
lock over by creating the next number, and says whose it was. Release deletes the holder's
object; the next run starts again from an empty series.

A holder that stopped renewing for longer than the expiry (a paused VM, a network partition)
and then comes back finds a higher number at its next renewal: it has lost the workdir, says
so on stderr once, and stops renewing.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import threading
import time

from nnx_zoo.errors import UsageError
from nnx_zoo.runtime import storage
from nnx_zoo.runtime.console import warn

TTL_ENV = "NNX_ZOO_LOCK_TTL_S"
DEFAULT_TTL_S = 300.0


def ttl_s() -> float:
    raw = os.environ.get(TTL_ENV, "")
    try:
        value = float(raw) if raw else DEFAULT_TTL_S
    except ValueError:
        value = -1.0
    if not value > 0:
        raise UsageError(f"{TTL_ENV}={raw!r} must be a number of seconds > 0")
    return value


class ObjectStoreLock:
    """An exclusive, expiring lock on an object-store run directory; `release()` (also at
    exit) frees it."""

    def __init__(self, workdir: str, lock_name: str):
        self.workdir = workdir
        self.prefix = storage.join(workdir, lock_name)
        self.ttl = ttl_s()
        self.path: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _epochs(self) -> list[int]:
        return sorted(int(n) for n in storage.listdir(self.prefix) if n.isdigit())

    def _path(self, epoch: int) -> str:
        return storage.join(self.prefix, f"{epoch:010d}")

    def _holder(self, epoch: int) -> tuple[dict, float] | None:
        """(record, seconds since its last renewal) of `epoch`, or None if it is gone."""
        path = self._path(epoch)
        try:
            record = json.loads(storage.read_bytes(path))
            age = time.time() - storage.modified(path)
        except FileNotFoundError:
            return None
        except ValueError:  # a record cut short cannot be: objects are written whole
            record, age = {"holder": "a run whose lock record is unreadable"}, 0.0
        return record, age

    def _record(self) -> bytes:
        me = f"pid {os.getpid()} on host {socket.gethostname()} (since {time.strftime('%c')})"
        self._me = getattr(self, "_me", me)
        return json.dumps({"holder": self._me, "ttl_s": self.ttl}).encode()

    def acquire(self) -> str | None:
        """Take the lock. UsageError naming the holder while another run's lock is live;
        returns a warning line when it took over an expired one, else None."""
        for _ in range(3):  # a holder releasing while we look: look again
            epochs = self._epochs()
            previous = None
            target = 0
            if epochs:
                newest = self._holder(epochs[-1])
                if newest is None:
                    continue
                record, age = newest
                ttl = float(record.get("ttl_s", self.ttl))
                if age < ttl:
                    raise self._busy(record, age, ttl)
                previous = f"{record.get('holder', 'an earlier run')} (last renewed {age:.0f}s ago)"
                target = epochs[-1] + 1
            path = self._path(target)
            if not storage.create(path, self._record()):
                winner = self._holder(target)
                if winner is None:
                    continue
                record, age = winner
                raise self._busy(record, age, float(record.get("ttl_s", self.ttl)))
            self.path = path
            self._epoch = target
            for old in epochs:  # the series restarts short; failures here cost nothing
                with contextlib.suppress(OSError):
                    storage.remove(self._path(old))
            self._thread = threading.Thread(target=self._renew, name="workdir-lock", daemon=True)
            self._thread.start()
            atexit.register(self.release)
            if previous:
                return f"took over the expired lock of {previous}, which is no longer renewing it"
            return None
        raise UsageError(f"workdir {self.workdir}: its lock {self.prefix} keeps changing; retry")

    def _busy(self, record: dict, age: float, ttl: float) -> UsageError:
        return UsageError(
            f"workdir {self.workdir} is in use by {record.get('holder', 'another run')} (its "
            f"lock was renewed {age:.0f}s ago and expires {ttl - age:.0f}s after the holder "
            "stops); wait for that run to end, or choose another --workdir"
        )

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            try:
                if any(e > self._epoch for e in self._epochs()):
                    warn(
                        f"lost the lock of workdir {self.workdir}: it was not renewed for "
                        f"{self.ttl:.0f}s and another run took it over; this run's further "
                        "writes there collide with that run's"
                    )
                    return
                storage.write_bytes(self.path, self._record())
            except Exception as e:  # noqa: BLE001 -- a missed renewal is retried; say why once
                warn(f"could not renew the lock {self.path} ({type(e).__name__}: {e})")

    def release(self) -> None:
        if self.path is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        try:
            if not any(e > self._epoch for e in self._epochs()):
                storage.remove(self.path)
        except OSError:
            pass  # the lock then expires by itself
        self.path = None
