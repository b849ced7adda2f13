"""Huge pages for the host allocator (nnx_zoo/runtime/cpu_memory.py): only when the user asks
(ZOO_HUGE_PAGES=1), then a restart with glibc's tunable that keeps the process (pid, argv,
environment); asked for where it cannot apply, one warning and no restart."""

import os
import subprocess
import sys

from nnx_zoo.runtime.cpu_memory import ENABLE_ENV, TUNABLE, _thp_mode, huge_page_environ

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOST = dict(system="linux", glibc=(2, 36), thp_mode="madvise")
ASKED = {ENABLE_ENV: "1"}


def test_nothing_unless_asked():
    # Before: every entry point restarted itself on such a host, unasked.
    assert huge_page_environ({}, **HOST) == (None, None)
    assert huge_page_environ({ENABLE_ENV: "0"}, **HOST) == (None, None)


def test_asked_restarts_with_the_tunable_on_a_madvise_linux_host():
    env, why_not = huge_page_environ({"A": "1", **ASKED}, **HOST)
    assert env == {"A": "1", **ASKED, "GLIBC_TUNABLES": f"{TUNABLE}=1"} and why_not is None
    # Other tunables the user set are kept.
    env, _ = huge_page_environ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", **ASKED}, **HOST)
    assert env["GLIBC_TUNABLES"] == f"glibc.malloc.arena_max=2:{TUNABLE}=1"


def test_asked_where_it_cannot_apply_says_why():
    # The user's own setting of the tunable, and huge pages already always on: nothing to do.
    assert huge_page_environ({"GLIBC_TUNABLES": f"{TUNABLE}=0", **ASKED}, **HOST) == (None, None)
    assert huge_page_environ(ASKED, **{**HOST, "thp_mode": "always"}) == (None, None)
    for fact, value, said in [
        ("system", "darwin", "needs Linux with glibc >= 2.35"),
        ("glibc", (2, 31), "needs Linux with glibc >= 2.35"),  # before the tunable existed
        ("thp_mode", "never", "transparent huge pages are never here"),
    ]:
        env, why_not = huge_page_environ(ASKED, **{**HOST, fact: value})
        assert env is None and said in why_not, (fact, why_not)


CHILD = """
import os, sys
if __name__ == "__main__":
    from nnx_zoo.runtime.cpu_memory import reexec_with_huge_pages
    print("start", os.getpid(), os.environ.get("GLIBC_TUNABLES", ""), sys.argv[1:], flush=True)
    reexec_with_huge_pages()
    print("run", os.getpid(), os.environ.get("GLIBC_TUNABLES", ""), sys.argv[1:], flush=True)
"""


def _child(tmp_path, **extra):
    script = tmp_path / "entry.py"
    script.write_text(CHILD)
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", ENABLE_ENV)}
    env.update(PYTHONPATH=ROOT, **extra)
    done = subprocess.run(
        [sys.executable, str(script), "--x=1"], env=env, capture_output=True, text=True, check=True
    )
    return env, done, [line.split(" ", 3) for line in done.stdout.splitlines()]


def test_unasked_the_process_runs_as_it_started(tmp_path):
    _, done, lines = _child(tmp_path)
    assert [line[0] for line in lines] == ["start", "run"] and done.stderr == ""
    assert TUNABLE not in lines[-1][2]


def test_the_restart_keeps_pid_and_arguments(tmp_path):
    env, done, lines = _child(tmp_path, **ASKED)
    restarts = huge_page_environ(env)[0] is not None
    expected = ["start"] + (["start"] if restarts else []) + ["run"]
    assert [line[0] for line in lines] == expected, done.stdout
    assert len({line[1] for line in lines}) == 1  # one process throughout
    assert all(line[3] == "['--x=1']" for line in lines)
    assert (f"{TUNABLE}=1" in lines[-1][2]) == restarts
    # Restarted where transparent huge pages wait for madvise (as on the host that measured
    # it); elsewhere at most the one line saying why not.
    assert not restarts or _thp_mode() == "madvise"
    assert len(done.stderr.splitlines()) <= 1 and not (restarts and done.stderr)
