"""Run an entry point (train_main, eval_main, export_main, plan_main, explain_main) inside the
pytest worker: the same flag parsing, build and outputs as `python train_main.py ARGS`, its exit
status as `returncode`, its stdout and stderr as text. The worker's imported JAX and compiled
functions are shared, so a run costs its steps, not a process start and a compile.

A test starts a process only where the process is the subject: signals and kills, the workdir
lock between processes, several processes, an entry point's own stderr/exit contract (a few
per entry point), the wheel.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import os
import sys
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # the *_main modules are scripts at the root
    sys.path.insert(0, ROOT)


@dataclasses.dataclass(frozen=True)
class Result:
    """What a process running the entry point would have left: exit status, stdout, stderr."""

    returncode: int
    stdout: str
    stderr: str


def run_main(module: str, args: list[str], *, cwd: str = ROOT) -> Result:
    """`python {module}.py *args` started in `cwd` (default: the checkout, as the tests'
    processes are), in this process. The module is (re)loaded with `sys.argv` set to the
    command line, as a fresh process would load it: its flags (the `--config.*` overrides
    among them) are defined against that command line."""
    # Not `*_main.py`: with ZOO_HUGE_PAGES=1, argv[0] of that form would re-execute this process.
    argv = [module, *[str(a) for a in args]]
    # The environment too: plan_main and explain_main add the CPU device count their command
    # line asks for to XLA_FLAGS at import (a process's own start-up), and every process a
    # later test of this worker starts would inherit it (a bench on 3 devices, not 8).
    saved_argv, saved_cwd, saved_environ = sys.argv, os.getcwd(), dict(os.environ)
    out, err = io.StringIO(), io.StringIO()
    code = 0
    sys.argv = list(argv)
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                if module in sys.modules:
                    entry = importlib.reload(sys.modules[module])
                else:
                    entry = importlib.import_module(module)
                entry.run()
            except SystemExit as e:
                code = _exit_status(e.code, err)
            except BaseException:  # noqa: BLE001 -- a bug: the traceback, as Python prints it
                traceback.print_exc(file=err)
                code = 1
    finally:
        sys.argv = saved_argv
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_environ)
    return Result(code, out.getvalue(), err.getvalue())


def _exit_status(code, err) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=err)  # sys.exit("message"): Python prints it and exits 1
    return 1


def train(args: list[str]) -> Result:
    return run_main("train_main", args)


def evaluate(args: list[str]) -> Result:
    return run_main("eval_main", args)


def export(args: list[str], *, cwd: str = ROOT) -> Result:
    return run_main("export_main", args, cwd=cwd)


def plan(args: list[str]) -> Result:
    return run_main("plan_main", args)


def explain(args: list[str]) -> Result:
    return run_main("explain_main", args)
