"""Huge pages for the host allocator (nnx_zoo/runtime/cpu_memory.py): when the entry points restart
with glibc's tunable, and that the restart keeps the process (pid, argv, environment)."""

import os
import subprocess
import sys

from nnx_zoo.runtime.cpu_memory import TUNABLE, _thp_mode, huge_page_environ
from nnx_zoo.runtime.xla_cpu import DISABLE_ENV

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOST = dict(system="linux", glibc=(2, 36), thp_mode="madvise", accelerator=False)


def test_restarts_with_the_tunable_on_a_madvise_linux_cpu_host():
    env = huge_page_environ({"A": "1"}, **HOST)
    assert env == {"A": "1", "GLIBC_TUNABLES": f"{TUNABLE}=1"}
    # Other tunables the user set are kept.
    env = huge_page_environ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, **HOST)
    assert env["GLIBC_TUNABLES"] == f"glibc.malloc.arena_max=2:{TUNABLE}=1"


def test_no_restart_where_it_cannot_help_or_is_not_wanted():
    assert huge_page_environ({"GLIBC_TUNABLES": f"{TUNABLE}=0"}, **HOST) is None  # user's
    assert huge_page_environ({DISABLE_ENV: "0"}, **HOST) is None
    for fact, value in [
        ("system", "darwin"),
        ("glibc", (2, 31)),  # before the tunable existed
        ("thp_mode", "always"),  # huge pages without asking
        ("thp_mode", "never"),  # the tunable would do nothing
        ("accelerator", True),
    ]:
        assert huge_page_environ({}, **{**HOST, fact: value}) is None, fact


CHILD = """
import os, sys
if __name__ == "__main__":
    from nnx_zoo.runtime.cpu_memory import reexec_with_huge_pages
    print("start", os.getpid(), os.environ.get("GLIBC_TUNABLES", ""), sys.argv[1:], flush=True)
    reexec_with_huge_pages()
    print("run", os.getpid(), os.environ.get("GLIBC_TUNABLES", ""), sys.argv[1:], flush=True)
"""


def test_the_restart_keeps_pid_and_arguments(tmp_path):
    script = tmp_path / "entry.py"
    script.write_text(CHILD)
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", DISABLE_ENV)}
    env["PYTHONPATH"] = ROOT
    done = subprocess.run(
        [sys.executable, str(script), "--x=1"], env=env, capture_output=True, text=True, check=True
    )
    lines = [line.split(" ", 3) for line in done.stdout.splitlines()]
    restarts = huge_page_environ(env) is not None
    expected = ["start"] + (["start"] if restarts else []) + ["run"]
    assert [line[0] for line in lines] == expected, done.stdout
    assert len({line[1] for line in lines}) == 1  # one process throughout
    assert all(line[3] == "['--x=1']" for line in lines)
    assert (f"{TUNABLE}=1" in lines[-1][2]) == restarts
    # A restart only where transparent huge pages wait for madvise (as on the host that
    # measured it; elsewhere the entry points run as they are).
    assert not restarts or _thp_mode() == "madvise"
