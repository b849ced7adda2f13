"""The console scripts pyproject.toml installs: `zoo-train ARGS` is `python -m train_main ARGS`.

Each runs its `*_main` module as `__main__`, as `python -m` does, so an installed command
behaves exactly like the checkout's `python train_main.py`: the same start-up (huge pages
restart, CPU flags), the same `--help` (absl lists the flags of the module it runs as main,
and prints that module's docstring), the same exit statuses.
"""

from __future__ import annotations

import runpy


def _run(module: str) -> None:
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def train() -> None:
    _run("train_main")


def evaluate() -> None:
    _run("eval_main")


def plan() -> None:
    _run("plan_main")


def explain() -> None:
    _run("explain_main")


def export() -> None:
    _run("export_main")
