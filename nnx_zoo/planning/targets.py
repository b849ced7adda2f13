"""Abstract TPU / GPU devices by name, for compiling a step on a host that has neither.

    target_devices("v5p:2x2x2")   # 8 TPU v5p chips (libtpu, extra [tpu])
    target_devices("h100:8")      # one host of 8 H100s (CUDA plugin, extra [gpu])
    target_devices("h100:2x8")    # two hosts of 8 H100s

A mesh built on these devices lowers and compiles with the real TPU / GPU compiler; the
result can be inspected (memory, HLO) but not run. TPU names are libtpu's topology names
(`<generation>:<chips per dim>`); GPU names are `<chip>:<gpus per host>` or
`<chip>:<hosts>x<gpus per host>`, each chip described by a target-config file shipped in
nnx_zoo/planning/gpu_targets/ (XLA's GPU target-config text format).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re

from nnx_zoo.errors import UsageError
from nnx_zoo.runtime.console import one_line

# The TPU generations whose topologies give one device per chip (what jax.make_mesh wants).
# v4 reports two devices per chip ("megacore"), which mesh construction refuses.
TPU_GENERATIONS = ("v5p", "v5e", "v6e")
# Chip name -> target-config file in nnx_zoo/planning/gpu_targets/.
GPU_TARGETS = {"h100": "h100_sxm.txtpb", "h200": "h200_sxm.txtpb"}
# NVLink domain of one HGX host.
_MAX_GPUS_PER_HOST = 8

_TPU_NAME = re.compile(r"^(v\w+):(\d+(?:x\d+){1,2})$")
_GPU_NAME = re.compile(r"^([a-z]\w*):(?:(\d+)x)?(\d+)$")
# Target names to show a user (plan_main's --topology help, these errors).
EXAMPLES = (
    "v5p:2x2x2",
    "v5p:4x4x4",
    "v6e:4x4",
    "v6e:2x4",
    "v5e:2x4",
    "h100:8",
    "h200:8",
    "h100:2x8",
)
_EXAMPLES = ", ".join(EXAMPLES)
_TARGET_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_targets")


class TargetError(UsageError):
    """A target that cannot be built here; str() is one line: the problem and what is valid."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


def target_platform(topology: str) -> str:
    """'tpu' or 'gpu' for a target name, from the name alone (nothing is loaded)."""
    return _parse(topology)[0]


def target_devices(topology: str) -> list:
    """The abstract devices of `topology`, in the order the topology lists them."""
    return list(_devices(topology))


@functools.cache
def _devices(topology: str) -> tuple:
    platform, chip, hosts, per_host = _parse(topology)
    if platform == "tpu":
        _require("libtpu", "tpu", "TPU")
        # Other engineers / test workers may hold libtpu; compiling only, so sharing is safe.
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        from nnx_zoo.runtime.host import native_stderr_dropped

        # libtpu's start-up lines on a host without a TPU (five, one an E0000) come before
        # its logging starts, so its log-level variables do not reach them (measured:
        # docs/performance.md, "Start-up"). Dropped here only: the user asked for this target.
        with native_stderr_dropped():
            desc = _topology_desc(topology, dict(topology_name=topology, platform="tpu"))
    else:
        _require("jax_plugins.xla_cuda12", "gpu", "GPU")
        with open(os.path.join(_TARGET_DIR, GPU_TARGETS[chip])) as f:
            target_config = f.read()
        # The plugin's topology: "<partitions>x<hosts per partition>x<devices per host>".
        kwargs = dict(platform="cuda", topology=f"1x{hosts}x{per_host}")
        desc = _topology_desc(topology, dict(kwargs, target_config=target_config))
    return tuple(desc.devices)


def _parse(topology: str) -> tuple[str, str, int, int]:
    """(platform, chip, hosts, devices per host); hosts/devices are 0 for TPU names."""
    if not isinstance(topology, str):
        raise TargetError(f"target {topology!r} is not a name; valid e.g.: {_EXAMPLES}")
    name = topology.strip().lower()
    tpu = _TPU_NAME.match(name)
    if tpu:
        if tpu.group(1) not in TPU_GENERATIONS:
            raise TargetError(
                f"TPU generation {tpu.group(1)!r} in target {topology!r} is not supported; "
                f"valid: {', '.join(TPU_GENERATIONS)} (e.g. v5p:2x2x2, v6e:4x4)"
            )
        return "tpu", tpu.group(1), 0, 0
    gpu = _GPU_NAME.match(name)
    if gpu and gpu.group(1) in GPU_TARGETS:
        hosts, per_host = int(gpu.group(2) or 1), int(gpu.group(3))
        if not (1 <= per_host <= _MAX_GPUS_PER_HOST) or hosts < 1:
            raise TargetError(
                f"target {topology!r}: a host holds 1 to {_MAX_GPUS_PER_HOST} GPUs and there is "
                f"at least one host; valid e.g. {gpu.group(1)}:8, {gpu.group(1)}:2x8"
            )
        return "gpu", gpu.group(1), hosts, per_host
    raise TargetError(
        f"unknown target {topology!r}; valid: <tpu generation>:<chips, e.g. 2x2x2> with "
        f"generation in {', '.join(TPU_GENERATIONS)}, or <gpu>:[<hosts>x]<gpus per host> with "
        f"gpu in {', '.join(GPU_TARGETS)}; e.g. {_EXAMPLES}"
    )


def _require(module: str, extra: str, what: str) -> None:
    if importlib.util.find_spec(module.split(".")[0]) is None or (
        "." in module and importlib.util.find_spec(module) is None
    ):
        raise TargetError(
            f"compiling for {what} targets needs the [{extra}] extra ({module} is not "
            f'installed); run: pip install -e ".[{extra}]"'
        )


def _topology_desc(name: str, kwargs: dict):
    from jax.experimental import topologies

    try:
        return topologies.get_topology_desc(**kwargs)
    except Exception as e:  # XLA's runtime errors are multi-line; keep the first line
        raise TargetError(
            f"cannot build target {name!r}: {one_line(e)}; valid e.g.: {_EXAMPLES}"
        ) from e
