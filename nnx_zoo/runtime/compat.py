"""What differs between the versions pyproject.toml admits, in one place, and what is installed.

pyproject.toml takes ranges (jax 0.10.2 up to the 0.12 series, with flax, optax, orbax and
grain to match). CI runs the suite at both ends (.ci/run): the floor on Python 3.11 and the
newest that resolves on Python 3.12. Where the two ends behave differently the difference is
handled here, by what the installed version does (never by importing jax's private modules),
and tests/test_compat.py checks each side: the recorded behaviour of each end, and the live
behaviour of whichever end is installed.

Known differences:
- The error a `jax.custom_vjp` backward rule raises when its cotangent's type (here: its
  sharding) differs from the primal input's. jax 0.10.2: "Custom VJP bwd rule must produce
  an output with the same type ..."; jax 0.11 and 0.12: "Custom VJP bwd rule attached to
  FUNCTION at FILE:LINE must produce an output with the same type ...".
  `CUSTOM_VJP_TYPE_MISMATCH` matches both.

`python -m nnx_zoo.runtime.compat` prints the installed versions (CI prints them at the top of each
leg).
"""

from __future__ import annotations

import platform
import re
from importlib import metadata

# Both wordings of jax's custom-VJP cotangent type check (see the module docstring).
CUSTOM_VJP_TYPE_MISMATCH = re.compile(
    r"Custom VJP bwd rule (?:attached to .+? )?must produce an output with the same type"
)

# The first jax whose wording names the call site (checked: 0.10.2 does not, 0.11.2 does).
CUSTOM_VJP_NAMES_CALL_SITE_SINCE = (0, 11)

# The distributions whose versions decide behaviour here (the extras' when installed).
DISTRIBUTIONS = (
    "jax",
    "jaxlib",
    "flax",
    "optax",
    "orbax-checkpoint",
    "grain",
    "libtpu",
    "jax-cuda12-plugin",
    "jax-cuda13-plugin",
    "nvidia-cudnn-cu12",
    "nvidia-cudnn-cu13",
)


def versions() -> dict[str, str]:
    """Python's version and each installed distribution's (absent ones left out)."""
    found = {"python": platform.python_version()}
    for name in DISTRIBUTIONS:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def jax_version() -> tuple[int, ...]:
    """The installed jax's release numbers, e.g. (0, 12, 0, 1)."""
    return tuple(int(p) for p in re.findall(r"\d+", metadata.version("jax").split("+")[0]))


if __name__ == "__main__":
    print(" ".join(f"{name}=={version}" for name, version in versions().items()))
