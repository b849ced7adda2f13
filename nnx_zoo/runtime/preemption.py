"""SIGTERM / SIGINT -> save at the current step, wait for the write, exit `EXIT_PREEMPTED`.

Schedulers (SLURM, Kubernetes, cloud TPU/GPU maintenance) send SIGTERM some seconds before
they kill a job. The handler only sets a flag (a signal handler must not touch JAX or Orbax:
it runs between two bytecodes of whatever the main thread was doing); the training loop asks
`should_stop(step)` once per step, at a point where the state is consistent, and then saves
with `force=True`, waits and leaves the loop:

    watcher = PreemptionWatcher()
    for step in ...:
        ...train step...
        if watcher.should_stop(step):
            ckpt.save(step, ..., force=True); ckpt.wait(); break
    watcher.close()

With several processes, the signal may reach them at different steps (or only some of them);
each process contributes its flag to a tiny all-gather at every check, so all of them see the
same answer at the same step and write the same checkpoint. One process skips the collective.

A run stopped this way exits with status `EXIT_PREEMPTED` (143, what a shell reports for a
process ended by SIGTERM), on every process, once its checkpoint is written: a scheduler's
requeue rule (Slurm's job script, a Kubernetes podFailurePolicy) tells it from a finished run
(0), a mistake in the input (2) and a failure (1). docs/cluster.md shows the rules.

A second SIGINT while the first is being handled restores Python's default behaviour
(KeyboardInterrupt), so Ctrl-C twice still aborts a save that hangs.
"""

from __future__ import annotations

import signal
import threading

import jax
import numpy as np
from absl import logging

SIGNALS = (signal.SIGTERM, signal.SIGINT)
# Stopped by a signal with the state saved: 128 + SIGTERM, as a shell reports a process that
# SIGTERM ended, so rules written for unhandled preemptions match a saved one too.
EXIT_PREEMPTED = 128 + signal.SIGTERM


class PreemptionWatcher:
    """Installs SIGTERM/SIGINT handlers that set a flag; `should_stop` reads it.

    Args:
      signals: which signals mean "save and stop".
      check_every: consult the flag (and, with several processes, run the all-gather) only
        at steps divisible by this, to keep the collective off most steps. Every process must
        use the same value.
    """

    def __init__(self, signals=SIGNALS, *, check_every: int = 1):
        if check_every < 1:
            raise ValueError(f"check_every={check_every} must be >= 1")
        self.check_every = check_every
        self.signal_received: int | None = None
        self.stopped_at: int | None = None  # the step at which should_stop first said True
        self._previous: dict[int, object] = {}
        self._stopped = False
        # signal.signal only works in the main thread; elsewhere (e.g. a test runner's worker)
        # the watcher still answers should_stop, it just never sees a signal.
        if threading.current_thread() is threading.main_thread():
            for sig in signals:
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        del frame
        if self.signal_received is not None and signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        self.signal_received = signum
        # logging from a handler is not strictly reentrant-safe, but absl's handler only
        # formats and writes one line; worth it to see the reason in the job's log.
        logging.warning(
            "received %s: will save and stop at the next step boundary", signal.Signals(signum).name
        )

    @property
    def requested(self) -> bool:
        """Whether this process has received a signal (no collective)."""
        return self.signal_received is not None

    def should_stop(self, step: int) -> bool:
        """True once a signal arrived on any process; the same answer on all processes."""
        if self._stopped:
            return True
        if step % self.check_every:
            return False
        flag = self.requested
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            flags = multihost_utils.process_allgather(np.asarray(flag, np.int32))
            flag = bool(np.asarray(flags).any())
        self._stopped = flag
        if flag:
            self.stopped_at = step
        return flag

    def close(self) -> None:
        """Put the previous handlers back."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def __enter__(self) -> PreemptionWatcher:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
