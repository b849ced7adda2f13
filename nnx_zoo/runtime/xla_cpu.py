"""XLA CPU flags for processes this project starts (train_main, eval_main, the benches), when
the user asks for them: `ZOO_XLA_CPU_FLAGS=1`.

XLA's default CPU dot kernel is Eigen's; `--xla_cpu_experimental_ynn_fusion_type=dot` sends
float32 dots to YNNPACK kernels instead. Measured on the recent development hosts it buys
nothing or loses (docs/performance.md, "XLA CPU flags and huge pages"), so no process gets it
unasked. The flag is experimental: XLA aborts the process on a flag it does not know, so it
is added only where the running XLA takes it: `xla_takes` starts a CPU client with the flag
in a subprocess once per jaxlib version and keeps the answer in
`$XDG_CACHE_HOME/nnx_zoo/xla_flags.json` (else `~/.cache/...`).

Call `set_cpu_flags()` before the first JAX computation (XLA reads XLA_FLAGS when the CPU
client starts). A flag the user already put in XLA_FLAGS wins over ours.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import MutableMapping
from importlib import metadata

# Each: (flag name, value, why).
CPU_FLAGS = (
    (
        "xla_cpu_experimental_ynn_fusion_type",
        "dot",
        "float32 dots through YNNPACK kernels instead of Eigen",
    ),
)

ENABLE_ENV = "ZOO_XLA_CPU_FLAGS"
_CACHE_FILE = "xla_flags.json"
# A CPU client started with the flag: XLA parses XLA_FLAGS then, and aborts on one it does not
# know. JAX_PLATFORMS=cpu: only that client, whatever accelerators the host has.
_PROBE = "import jax; jax.devices('cpu')"


def _cache_path() -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "nnx_zoo", _CACHE_FILE)


def _read_cache(path: str) -> dict:
    try:
        with open(path) as f:
            found = json.load(f)
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def xla_takes(flag: str) -> bool:
    """Whether the installed XLA starts a CPU client with `flag` ('--name=value') in XLA_FLAGS.
    Probed in a subprocess (about a second) the first time for each jaxlib version; the answer
    is kept in the cache file (a cache that cannot be written: probed each time)."""
    from nnx_zoo.runtime.files import write_json_atomic

    key = f"jaxlib=={metadata.version('jaxlib')} {flag}"
    path = _cache_path()
    cache = _read_cache(path)
    if isinstance(cache.get(key), bool):
        return cache[key]
    env = {**os.environ, "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"}
    probe = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, check=False, timeout=300
    )
    takes = probe.returncode == 0
    with contextlib.suppress(OSError):  # a read-only home: the answer holds for this process
        write_json_atomic(path, {**_read_cache(path), key: takes})
    return takes


def cpu_flags(xla_flags: str) -> str:
    """`xla_flags` with our flags appended for every flag it does not already set and the
    running XLA takes."""
    given = {part.lstrip("-").split("=", 1)[0] for part in xla_flags.split()}
    added = [
        f"--{name}={value}"
        for name, value, _ in CPU_FLAGS
        if name not in given and xla_takes(f"--{name}={value}")
    ]
    return " ".join([xla_flags.strip(), *added]).strip()


def set_cpu_flags(environ: MutableMapping[str, str] = os.environ) -> str:
    """Add our CPU flags to environ['XLA_FLAGS'] when environ asks for them
    (ZOO_XLA_CPU_FLAGS=1) and the running XLA takes them; returns the value."""
    current = environ.get("XLA_FLAGS", "")
    if environ.get(ENABLE_ENV, "0") != "1":
        return current
    flags = cpu_flags(current)
    if flags != current:
        environ["XLA_FLAGS"] = flags
    return flags
