"""What a process prints for its user: one line a message, from process 0 only (several
processes would print it once each), and errors cut to one line."""

from __future__ import annotations

import sys


def _process_0() -> bool:
    # Imported here: entry points load this module before they start jax (runtime/host.py).
    import jax

    return jax.process_index() == 0


def say(text: str) -> None:
    """`text` on stdout, from process 0."""
    if _process_0():
        print(text, flush=True)


def warn(text: str) -> None:
    """'warning: text' on stderr, where every entry point's warnings go, from process 0."""
    if _process_0():
        print(f"warning: {text}", file=sys.stderr, flush=True)


def one_line(error: BaseException) -> str:
    """The first line of `error`'s message, white space folded (its type's name when it has
    no message): what a one-line error quotes of a library's multi-line one."""
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    # tensorstore errors can embed the repr of a bound pybind11 method: cut it off.
    first = lines[0].split("<bound method", 1)[0].rstrip(" :(")
    return " ".join(first.split())
