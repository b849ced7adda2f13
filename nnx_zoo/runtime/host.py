"""The platform a run is on: JAX's choice, said in one line and recorded; and the one place a
native library's stderr is dropped (`native_stderr_dropped`, for libtpu when a user plans for
a TPU target).

JAX picks the backend (`JAX_PLATFORMS` when the user sets it, else the first that starts);
nothing here guesses from device paths or sets `JAX_PLATFORMS`. Where the user asks for an
accelerator (every platform `JAX_PLATFORMS` names is one) and JAX finds none, that is a
`UsageError` (exit 2, one line). What the native libraries print at start-up and which of it
environment variables silence: docs/performance.md, "Start-up".
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from collections.abc import Mapping

from nnx_zoo.errors import UsageError

# The names JAX_PLATFORMS takes for an accelerator (`gpu` is cuda or rocm, whichever starts).
ACCELERATORS = {"tpu": ("tpu",), "cuda": ("gpu",), "rocm": ("gpu",), "gpu": ("gpu",)}


def requested_accelerators(environ: Mapping[str, str] = os.environ) -> tuple[str, ...]:
    """The accelerators JAX_PLATFORMS asks for when it names nothing else, else (): a list
    that names `cpu` too (`cuda,cpu`) lets JAX fall back to the CPU, as the user wrote."""
    names = [n.strip().lower() for n in environ.get("JAX_PLATFORMS", "").split(",") if n.strip()]
    if names and all(n in ACCELERATORS for n in names):
        return tuple(names)
    return ()


@dataclasses.dataclass(frozen=True)
class Platform:
    """What JAX runs on in this process (run_info.json's `platform`)."""

    jax: str
    backend: str  # jax.default_backend(): cpu, gpu, tpu
    device_kind: str  # of the first device: "cpu", "NVIDIA H100 80GB HBM3", "TPU v5p"
    device_count: int  # every process's devices
    process_count: int

    def line(self) -> str:
        """The first line of a run, e.g. 'jax 0.10.2 on cpu: 8 x cpu devices'."""
        processes = f" in {self.process_count} processes" if self.process_count > 1 else ""
        plural = "s" if self.device_count != 1 else ""
        return (
            f"jax {self.jax} on {self.backend}: {self.device_count} x {self.device_kind} "
            f"device{plural}{processes}"
        )

    def record(self) -> dict:
        return dataclasses.asdict(self)


def platform(environ: Mapping[str, str] = os.environ) -> Platform:
    """The backend JAX chose (starting it: call after `jax.distributed.initialize`), checked
    against what the user asked for: UsageError when JAX_PLATFORMS names only accelerators and
    JAX starts none of them."""
    import jax

    from nnx_zoo.runtime.console import one_line

    wanted = requested_accelerators(environ)
    asked = f"JAX_PLATFORMS={environ.get('JAX_PLATFORMS', '')}"
    remedy = "run on a host that has one, or unset JAX_PLATFORMS to let jax choose"
    try:
        devices = jax.devices()
    except RuntimeError as e:
        if not wanted:
            raise  # JAX's own choice failed: not the user's input
        raise UsageError(
            f"{asked} asks for an accelerator and jax found none ({one_line(e)}); {remedy}"
        ) from e
    backend = jax.default_backend()
    if wanted and not any(backend in ACCELERATORS[name] for name in wanted):
        raise UsageError(
            f"{asked} asks for an accelerator and jax started {backend} instead; {remedy}"
        )
    return Platform(
        jax=jax.__version__,
        backend=backend,
        device_kind=devices[0].device_kind,
        device_count=len(devices),
        process_count=jax.process_count(),
    )


def announce(environ: Mapping[str, str] = os.environ) -> Platform:
    """`platform()`, said as a run's first line on stdout (process 0)."""
    from nnx_zoo.runtime.console import say

    found = platform(environ)
    say(found.line())
    return found


@contextlib.contextmanager
def native_stderr_dropped():
    """What native code writes to file descriptor 2 inside the block is dropped, for the whole
    process while it runs.

    Only for a call a user made to ask for it: libtpu, loaded to compile for a TPU target on a
    host without one, logs at length (five lines, one an E0000 INVALID_ARGUMENT) before its
    own logging starts, so no environment variable of libtpu's reaches them (measured:
    docs/performance.md, "Start-up"). Its failures still raise, with their message."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
