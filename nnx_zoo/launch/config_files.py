"""Where a `--config` value points: a file as given, or a config that ships in the `configs`
package (found by its path, not imported: `configs` imports the run config's dataclasses from
`nnx_zoo.training`, and launch stays below it).

The docs say `--config=configs/tiny.py`, which names a file only from the checkout's root. An
installed package (`pip install nnx-zoo`, then `zoo-train` from any directory) carries the
same files inside the `configs` package, so a value that is not an existing file is looked up
there: by name (`tiny`, `tiny.py`) or by that checkout-relative path (`configs/tiny.py`). A file
that exists always wins, so a user's own `configs/tiny.py` in the working directory is theirs.
"""

from __future__ import annotations

import os
import re

# configs/ sits beside the nnx_zoo package at the top level (checkout and wheel alike).
PACKAGE_DIR = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs"
)


def names() -> list[str]:
    """The configs shipped here (the files defining `get_config`), e.g. ['llama3_1b', 'tiny']."""
    found = []
    for entry in sorted(os.listdir(PACKAGE_DIR)):
        if not entry.endswith(".py") or entry.startswith("_"):
            continue
        with open(os.path.join(PACKAGE_DIR, entry), encoding="utf-8") as f:
            if re.search(r"^def get_config\(", f.read(), re.MULTILINE):
                found.append(entry.removesuffix(".py"))
    return found


def config_path(value: str) -> str:
    """`value` (a path, with `~` expanded, or a shipped config's name) as a file path.

    ml_collections lets a config file take an argument after a colon (`FILE:ARG`); it is kept.
    A value that is neither an existing file nor a shipped name comes back as given, so the
    loader's own error names it."""
    path, colon, arg = value.partition(":")
    path = os.path.expanduser(path)
    if not os.path.exists(path):
        name = os.path.basename(path).removesuffix(".py")
        parent = os.path.dirname(os.path.normpath(path))
        # Only bare names and `.../configs/NAME(.py)`: another directory's file is not ours.
        ours = parent == "" or os.path.basename(parent) == "configs"
        if ours and name in names():
            path = os.path.join(PACKAGE_DIR, f"{name}.py")
    return f"{path}{colon}{arg}"


def resolve_argv(argv: list[str]) -> list[str]:
    """`argv` with every `--config=VALUE` replaced by `--config=config_path(VALUE)` (absl flags
    and config_flags take the rest as they are)."""
    return [
        f"--config={config_path(a.split('=', 1)[1])}" if a.startswith("--config=") else a
        for a in argv
    ]
