"""Start-up on the host the entry points run on; imports nothing from jax (it runs first).

With the [tpu] and [gpu] extras installed (to compile for those chips), importing jax on a
host with neither loads libtpu and the CUDA plugin, which print several lines to stderr
saying there is no TPU / no CUDA driver. Entry points promise one line on stderr for a bad
input, so on such a host those lines are kept off stderr; on a TPU or GPU host nothing
changes.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import importlib.util
import os
import sys


def has_nvidia_gpu() -> bool:
    return os.path.exists("/dev/nvidiactl") or bool(glob.glob("/dev/nvidia[0-9]*"))


def has_tpu() -> bool:
    # TPU VMs expose chips as /dev/accel* (v4, v5e, v6e) or VFIO groups (v5p).
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def import_jax_quietly() -> None:
    """Import jax; on a host with no accelerator, default to the CPU platform (so libtpu does
    not probe for chips) and keep the native libraries' start-up lines off stderr."""
    if has_nvidia_gpu() or has_tpu():
        import jax  # noqa: F401

        return
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        import jax  # noqa: F401

        # The CUDA plugin's library logs the missing driver when jax first loads it (at
        # backend start-up, later than this); loaded now, it has said so into /dev/null.
        try:
            spec = importlib.util.find_spec("jax_plugins.xla_cuda12")
        except ModuleNotFoundError:  # no plugin package at all: the [gpu] extra is absent
            spec = None
        for library in (
            glob.glob(os.path.join(os.path.dirname(spec.origin), "*.so")) if spec else ()
        ):
            with contextlib.suppress(OSError):
                ctypes.CDLL(library)
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


@contextlib.contextmanager
def native_stderr_dropped():
    """On a host with no TPU / GPU: what native code writes to stderr inside the block is
    dropped. For loading libtpu to compile for a TPU target, which then logs at length (and
    at ERROR level) that this host has no TPU; its failures still raise, and the entry point
    prints them in one line. On a TPU or GPU host nothing changes."""
    if has_nvidia_gpu() or has_tpu():
        yield
        return
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
