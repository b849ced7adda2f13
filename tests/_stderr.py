"""A process's stderr as the tests read it: less the lines JAX's CUDA plugin prints when it is
installed on a host without a GPU, which no environment variable silences (measured:
docs/performance.md, "Start-up"); every other line is kept as written.

`import jax` loads the plugin's libraries (the [gpu] extra, installed on the test hosts to
compile for GPU targets), and each logs through absl before absl is initialised: the notice
below, then the missing driver at INFO. The entry points promise one line of their own for
a bad input; these are JAX's, the same in any program that imports it here.
"""

from __future__ import annotations

import re

_CUDA_PLUGIN = re.compile(
    r"WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
    r"|I\d{4} [\d:.]+ +\d+ cudart_stub\.cc:\d+\] Could not find cuda drivers on "
    r"your machine, GPU will not be used\."
)


def ours(stderr: str) -> str:
    """`stderr` without the CUDA plugin's start-up lines."""
    lines = stderr.splitlines(keepends=True)
    return "".join(line for line in lines if not _CUDA_PLUGIN.fullmatch(line.rstrip("\n")))
