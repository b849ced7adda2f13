"""The one error type for a mistake in what the user gave: flags, config, data, paths, meshes.

Every package raises `UsageError` where it checks its input (it sits at the bottom of the
import graph, so `shardings` and `zoo` may raise it too). An entry point turns it into one
line and exit status 2; anything else -- JAX's own errors, a bug of ours -- exits 1 with its
traceback. It is a `ValueError`, so code that caught a bad value before still catches it.
"""

from __future__ import annotations


class UsageError(ValueError):
    """A mistake in the user's input, with one line that names it and what would be valid."""


INTERNAL_ERROR_LINE = (
    "error: the failure above is not a mistake in the input: it is a bug in nnx-zoo or in a "
    "library it uses; report it to nnx-zoo's issue tracker with this traceback, the command "
    "line and the output of `python -m nnx_zoo.runtime.compat`"
)


def report_internal(error: BaseException) -> None:
    """Print `error`'s traceback and the line saying it is not the user's input (to stderr)."""
    import sys
    import traceback

    traceback.print_exception(error)
    print(INTERNAL_ERROR_LINE, file=sys.stderr, flush=True)
