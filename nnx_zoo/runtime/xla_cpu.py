"""XLA CPU flags for processes this project starts (train_main, eval_main, the benches).

XLA's default CPU dot kernel (Eigen) reaches about half of what the XNNPACK-family library
kernels reach for the float32 matmuls of a transformer block on a small x86 host; the library
kernels are off by default in jax 0.10.2 and are turned on with a flag. `bench/
matmul_vs_torch.py` measures the kernels (and PyTorch's) on the model's matmul shapes.

Call `set_cpu_flags()` before the first JAX computation (XLA reads XLA_FLAGS when the CPU
client starts). A flag the user already put in XLA_FLAGS wins over ours, and
ZOO_XLA_CPU_DEFAULTS=0 adds none of them (to compare against XLA's own defaults).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

# Each: (flag name, value, why).
CPU_FLAGS = (
    (
        "xla_cpu_experimental_ynn_fusion_type",
        "dot",
        "float32 dots through YNNPACK kernels instead of Eigen: ~1.6-1.9x the matmul rate",
    ),
)

DISABLE_ENV = "ZOO_XLA_CPU_DEFAULTS"


def cpu_flags(xla_flags: str) -> str:
    """`xla_flags` with our defaults appended for every flag it does not already set."""
    given = {part.lstrip("-").split("=", 1)[0] for part in xla_flags.split()}
    added = [f"--{name}={value}" for name, value, _ in CPU_FLAGS if name not in given]
    return " ".join([xla_flags.strip(), *added]).strip()


def set_cpu_flags(environ: MutableMapping[str, str] = os.environ) -> str:
    """Add our CPU defaults to environ['XLA_FLAGS'] (unless turned off); returns the value."""
    current = environ.get("XLA_FLAGS", "")
    if environ.get(DISABLE_ENV, "1") == "0":
        return current
    environ["XLA_FLAGS"] = cpu_flags(current)
    return environ["XLA_FLAGS"]
