"""`--config.logging.profile_steps=START:END`: a `jax.profiler` trace of train steps START to
END-1 (the step numbers of metrics.jsonl), written under `<workdir>/profile` in the layout
TensorBoard's profile plugin / XProf read (`plugins/profile/<run>/*.xplane.pb`); Perfetto opens
the `.trace.json.gz` beside it where the profiler writes one. The same on CPU, GPU and TPU: it
is JAX's own profiler, no platform tool.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable

import jax

from nnx_zoo.errors import UsageError
from nnx_zoo.runtime import storage
from nnx_zoo.runtime.files import atomic_write

PROGRAM_FILE = "train_step.hlo.txt"  # the traced step's compiled program, beside its trace


def parse_steps(text: str) -> tuple[int, int] | None:
    """'START:END' -> (START, END) with 1 <= START < END; '' -> None. UsageError: one line."""
    if not text:
        return None
    start, sep, end = text.partition(":")
    try:
        steps = (int(start), int(end)) if sep else None
    except ValueError:
        steps = None
    if steps is None or not 1 <= steps[0] < steps[1]:
        raise UsageError(
            f"config logging.profile_steps={text!r}: expected START:END with 1 <= START < END "
            "(e.g. 5:8 traces steps 5, 6 and 7)"
        )
    return steps


class StepProfiler:
    """Starts the trace before step START runs and stops it once step END-1 has finished."""

    def __init__(
        self,
        steps: tuple[int, int] | None,
        workdir: str,
        program: Callable[[], str | None] | None = None,
    ):
        """`program()`: the compiled train step's HLO text (None: not compiled ahead of time),
        written beside the trace as `PROGRAM_FILE`: the trace names each kernel by its HLO
        instruction, and bench/step_breakdown.py reads what that instruction is from it."""
        self.steps = steps
        self.log_dir = os.path.join(workdir, "profile")
        # A bucket workdir: the profiler writes locally, and each process copies its files up
        # when the trace stops (nnx_zoo/runtime/storage.py).
        self.upload_to = None
        if storage.is_url(workdir):
            self.upload_to, self.log_dir = storage.join(workdir, "profile"), None
        self.program = program
        self.active = False

    def before(self, step: int) -> None:
        """Call with the number of the step about to run (1-based)."""
        if self.steps and step == self.steps[0] and not self.active:
            if self.log_dir is None:
                self.log_dir = tempfile.mkdtemp(prefix="nnx-zoo-profile-")
            text = self.program() if self.program is not None else None
            if text and jax.process_index() == 0:
                os.makedirs(self.log_dir, exist_ok=True)
                path = os.path.join(self.log_dir, PROGRAM_FILE)
                atomic_write(path, lambda f: f.write(text.encode()))
            jax.profiler.start_trace(self.log_dir)
            self.active = True

    def after(self, step: int, outputs) -> None:
        """Call with the number of the step that just ran and its outputs."""
        if self.active and step >= self.steps[1] - 1:
            self.stop(outputs)

    def stop(self, outputs=None) -> None:
        if self.active:
            jax.block_until_ready(outputs)  # the traced steps' device work is in the trace
            jax.profiler.stop_trace()
            self.active = False
            if self.upload_to is not None:
                storage.upload_tree(self.log_dir, self.upload_to)
