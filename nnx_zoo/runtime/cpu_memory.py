"""Huge pages for the host allocator, when the user asks for them: `ZOO_HUGE_PAGES=1`.

XLA CPU allocates each step's temporaries afresh, and glibc serves buffers above 32 MiB
(attention logits, MLP activations) with mmap and unmaps them when freed, so every step
faults its temporaries in again, 4 KiB at a time. With transparent huge pages in `madvise`
mode (the common Linux default), glibc's `glibc.malloc.hugetlb=1` tunable makes malloc ask
for 2 MiB pages instead. What that buys, measured: docs/performance.md, "XLA CPU flags and
huge pages".

glibc reads tunables once, when the process starts, so `reexec_with_huge_pages()` starts the
entry point again (same pid, argv and environment, plus the tunable) before anything heavy is
imported. Off unless ZOO_HUGE_PAGES=1: restarting a process is not something a command should
do unasked. Asked for where it cannot apply (not Linux with glibc >= 2.35, transparent huge
pages off), it says why on stderr and goes on; where they are `always` on, and where
GLIBC_TUNABLES already names the tunable (the user's own choice), nothing is needed.
"""

from __future__ import annotations

import contextlib
import os
import platform
import sys
from collections.abc import Mapping

TUNABLE = "glibc.malloc.hugetlb"
THP_MODE_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"
ENABLE_ENV = "ZOO_HUGE_PAGES"


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
) -> tuple[dict[str, str] | None, str | None]:
    """(the environment to restart with: `environ` plus the tunable, or None to go on as is;
    why not, when the user asked and it cannot apply, else None).

    The keyword arguments default to this host's facts (for tests: any host's)."""
    tunables = environ.get("GLIBC_TUNABLES", "")
    if environ.get(ENABLE_ENV, "0") != "1" or TUNABLE in tunables:
        return None, None
    system = sys.platform if system is None else system
    glibc = _glibc_version() if glibc is None else glibc
    thp_mode = _thp_mode() if thp_mode is None else thp_mode
    if not system.startswith("linux") or glibc is None or glibc < (2, 35):
        return None, f"{ENABLE_ENV}=1 needs Linux with glibc >= 2.35 ({TUNABLE}); not restarted"
    if thp_mode == "always":  # the allocator gets huge pages without asking
        return None, None
    if thp_mode != "madvise":
        return None, (
            f"{ENABLE_ENV}=1: transparent huge pages are {thp_mode or 'not available'} here, "
            "so the tunable would do nothing; not restarted"
        )
    new = ":".join(filter(None, [tunables, f"{TUNABLE}=1"]))
    return {**environ, "GLIBC_TUNABLES": new}, None


def reexec_with_huge_pages() -> None:
    """Restart this process with glibc's huge-page tunable when the user asked for it
    (ZOO_HUGE_PAGES=1) and `huge_page_environ` says it applies.

    Call it first thing in an entry point's `__main__`: the process is replaced, so
    nothing done before it survives. If the restart fails, this process goes on as it is."""
    env, why_not = huge_page_environ(os.environ)
    if why_not:
        print(f"warning: {why_not}", file=sys.stderr, flush=True)
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    with contextlib.suppress(OSError):
        os.execve(sys.executable, list(sys.orig_argv), env)
