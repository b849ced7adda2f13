"""Huge pages for the host allocator of processes this project starts on a CPU host.

XLA CPU allocates each step's temporaries afresh, and glibc serves buffers above 32 MiB
(attention logits, MLP activations) with mmap and unmaps them when freed, so every step
faults in its temporaries again, 4 KiB at a time: about 1M page faults and 2 s of system
time per train step of the `small` model (4x512 tokens; 11-12 s steps on 2 cores). With
transparent huge pages in `madvise` mode (the common Linux default), glibc's
`glibc.malloc.hugetlb=1` tunable makes malloc ask for 2 MiB pages: about 2k faults and
0.4 s. `bench/vs_transformers.py` measures the effect.

glibc reads tunables once, when the process starts, so `reexec_with_huge_pages()` starts the
entry point again (same pid, argv and environment, plus the tunable) before anything heavy is
imported. It does nothing where it cannot help or is not wanted: not Linux/glibc >= 2.35,
transparent huge pages not in `madvise` mode (`always` needs no tunable, `never` ignores
it), a GPU or TPU host, GLIBC_TUNABLES already naming `glibc.malloc.hugetlb`, or
ZOO_XLA_CPU_DEFAULTS=0 (which also drops the XLA CPU flags, nnx_zoo/runtime/xla_cpu.py).
"""

from __future__ import annotations

import contextlib
import os
import platform
import sys
from collections.abc import Mapping

from nnx_zoo.runtime.host import has_nvidia_gpu, has_tpu
from nnx_zoo.runtime.xla_cpu import DISABLE_ENV

TUNABLE = "glibc.malloc.hugetlb"
THP_MODE_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"


def _thp_mode() -> str | None:
    """'always' | 'madvise' | 'never' (the bracketed one in the sysfs file), or None."""
    try:
        with open(THP_MODE_FILE) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def _glibc_version() -> tuple[int, ...] | None:
    name, version = platform.libc_ver()
    if name != "glibc" or not version:
        return None
    return tuple(int(p) for p in version.split(".") if p.isdigit())


def huge_page_environ(
    environ: Mapping[str, str],
    *,
    system: str | None = None,
    glibc: tuple[int, ...] | None = None,
    thp_mode: str | None = None,
    accelerator: bool | None = None,
) -> dict[str, str] | None:
    """The environment to restart with (`environ` plus the tunable), or None to go on as is.

    The keyword arguments default to this host's facts (for tests: any host's)."""
    system = sys.platform if system is None else system
    glibc = _glibc_version() if glibc is None else glibc
    thp_mode = _thp_mode() if thp_mode is None else thp_mode
    accelerator = (has_nvidia_gpu() or has_tpu()) if accelerator is None else accelerator
    tunables = environ.get("GLIBC_TUNABLES", "")
    if (
        environ.get(DISABLE_ENV, "1") == "0"
        or not system.startswith("linux")
        or glibc is None
        or glibc < (2, 35)
        or thp_mode != "madvise"
        or accelerator
        or TUNABLE in tunables
    ):
        return None
    return {**environ, "GLIBC_TUNABLES": ":".join(filter(None, [tunables, f"{TUNABLE}=1"]))}


def reexec_with_huge_pages() -> None:
    """Restart this process with glibc's huge-page tunable when `huge_page_environ` says to.

    Call it first thing in an entry point's `__main__`: the process is replaced, so
    nothing done before it survives. If the restart fails, this process goes on as it is."""
    env = huge_page_environ(os.environ)
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    with contextlib.suppress(OSError):
        os.execve(sys.executable, list(sys.orig_argv), env)
