"""Chips the planner targets: memory, HBM and link bandwidths, each sourced; peak FLOP/s from
the one table of them, `training.flops.PEAKS`.

Bandwidths are bytes/s in ONE direction over ONE link (TPU ICI) or per GPU (NVLink through the
NVSwitch, InfiniBand NIC); `planning.estimate` turns them into the bandwidth of a mesh axis.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from nnx_zoo.errors import UsageError
from nnx_zoo.training.flops import PEAKS, peak_name

GiB = 1024**3
# JAX's GPU client caps its allocator at this fraction of the GPU's memory (preallocated, or
# grown up to it with XLA_PYTHON_CLIENT_PREALLOCATE=false): docs.jax.dev, "GPU memory
# allocation". A step that needs more is out of memory on the real chip even where the HBM
# would hold it (seen on an H100: llama3_1b 8x2048 remat=none, 61 GiB by the plan, ran out).
DEFAULT_GPU_MEMORY_FRACTION = 0.75


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    platform: str  # 'tpu' | 'gpu' | 'cpu'
    memory_bytes: int  # HBM per device
    peak_bf16_flops: float  # dense, per device
    link_bytes_per_s: float  # TPU: one ICI link, one way; GPU: NVLink per GPU, one way
    cross_host_bytes_per_s: float | None  # GPU: InfiniBand per GPU; TPU: DCN per chip
    # TPU: a physical torus dim of this many chips (or a multiple, on v5p) wraps around, so a
    # ring along it uses both directions of each link.
    wraparound_dim: int | None = None
    devices_per_host: int = 8  # GPU: NVLink domain; TPU: chips sharing a host's DCN NICs
    # Dense peak of matmuls on fp8 / int8 operands; None: no faster path than bf16 (the
    # quantized dot then runs at the bf16 rate, e.g. fp8 on TPU v5/v6).
    peak_fp8_flops: float | None = None
    peak_int8_flops: float | None = None
    # HBM bandwidth per device, bytes/s (the vendor's figure); None: no step forecast.
    hbm_bytes_per_s: float | None = None


# Sources:
# [tpu-v5p] cloud.google.com/tpu/docs/v5p: 459 TFLOP/s bf16, 95 GiB HBM at 2765 GB/s, DCN
#   50 Gbps per chip.
# [tpu-v5e] cloud.google.com/tpu/docs/v5e: 197 TFLOP/s bf16, 16 GiB HBM at 819 GB/s.
# [tpu-v6e] cloud.google.com/tpu/docs/v6e: 918 TFLOP/s bf16, 32 GiB HBM at 1640 GB/s.
# [scaling-book] jax-ml.github.io/scaling-book/tpus ("How to Scale Your Model", part 2): ICI
#   one-way bandwidth per link 9e10 B/s (v5p, v6e), 4.5e10 B/s (v5e); wraparound links only
#   on full 4-chip-multiple v5p dims and on 16-wide v5e/v6e dims.
# [h100] nvidia.com/en-us/data-center/h100 (SXM): 989 TFLOP/s bf16 dense, 80 GB HBM3 at 3.35 TB/s,
#   NVLink 900 GB/s bidirectional per GPU; DGX H100: one 400 Gb/s ConnectX-7 NIC per GPU.
# [h200] nvidia.com/en-us/data-center/h200 (SXM): 989 TFLOP/s bf16 dense, 141 GB HBM3e at 4.8 TB/s,
#   NVLink 900 GB/s bidirectional per GPU.


def _accelerator(key, name, platform, memory, hbm, link, cross_host, wraparound, per_host):
    """A row of `_ACCELERATORS` as a Chip (bytes, bytes/s), its peaks `PEAKS[key]`'s."""
    peak = PEAKS[key]
    return Chip(
        name,
        platform,
        memory_bytes=memory,
        peak_bf16_flops=peak.bf16,
        link_bytes_per_s=link,
        cross_host_bytes_per_s=cross_host,
        wraparound_dim=wraparound,
        devices_per_host=per_host,
        peak_fp8_flops=peak.fp8,
        peak_int8_flops=peak.int8,
        hbm_bytes_per_s=hbm,
    )


# Memory and HBM bandwidth from the vendor's page; TPU links and wraparound [scaling-book];
# v5p DCN: 50 Gbps per chip [tpu-v5p]; H100/H200: NVLink 900 GB/s bidirectional, one 400 Gb/s
# NIC per GPU [h100]. No fp8 peak on TPU (PEAKS): fp8 dots run at the bf16 rate there.
_ACCELERATORS = {
    # name, platform, memory, HBM B/s, link B/s one way, cross-host B/s, wraparound, per host
    "v5p": ("TPU v5p", "tpu", 95 * GiB, 2765e9, 9e10, 50e9 / 8, 4, 4),
    "v5e": ("TPU v5e", "tpu", 16 * GiB, 819e9, 4.5e10, None, 16, 8),
    "v6e": ("TPU v6e", "tpu", 32 * GiB, 1640e9, 9e10, None, 16, 8),
    "h100": ("NVIDIA H100 SXM", "gpu", 80 * 10**9, 3.35e12, 450e9, 400e9 / 8, None, 8),
    # NVIDIA sells the H200 as "141 GB"; those this project ran on report about 139 GiB to
    # CUDA (the whole HBM less what the driver keeps): what an allocator can have.
    "h200": ("NVIDIA H200 SXM", "gpu", 139 * GiB, 4.8e12, 450e9, 400e9 / 8, None, 8),
}
CHIPS: dict[str, Chip] = {
    **{key: _accelerator(key, *row) for key, row in _ACCELERATORS.items()},
    # The simulated CPU devices of this host, for tests and laptops: not a real chip. Its
    # figures are placeholders of the right order for one CPU core; give --memory_gib to make
    # a synthetic chip of any size.
    "cpu": Chip(
        "simulated CPU device",
        "cpu",
        memory_bytes=16 * GiB,
        peak_bf16_flops=1e11,
        link_bytes_per_s=1e10,
        cross_host_bytes_per_s=None,
    ),
}


def peak_flops(chip: Chip, quantization: str = "none") -> float:
    """Dense peak FLOP/s of `chip` for the projections' precision (model.quantization): the
    fp8 / int8 rate where the chip has one, else bf16's."""
    faster = {"fp8": chip.peak_fp8_flops, "int8": chip.peak_int8_flops}.get(quantization)
    return faster or chip.peak_bf16_flops


def gpu_memory_fraction(environ: Mapping[str, str] = os.environ) -> float:
    """The share of a GPU's memory a JAX process may use, from the variables JAX reads."""
    if environ.get("XLA_PYTHON_CLIENT_ALLOCATOR", "").lower() == "platform":
        return 1.0
    for name in ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION"):
        text = environ.get(name)
        if text:
            try:
                value = float(text)
            except ValueError:
                value = -1.0
            if not 0 < value <= 1:
                raise UsageError(f"{name}={text!r}: must be a number in (0, 1]")
            return value
    return DEFAULT_GPU_MEMORY_FRACTION


def chip_for(topology: str, memory_gib: float | None = None) -> Chip:
    """The chip of a topology name (`v5p:2x2x2`, `h100:8`, `cpu:8`); `memory_gib` replaces its
    memory (a synthetic chip: what fits in less, or more, memory). A GPU's memory is what
    JAX's allocator may take of it (`gpu_memory_fraction`), not the whole HBM."""
    kind = topology.split(":", 1)[0].lower()
    if kind not in CHIPS:
        raise UsageError(
            f"unknown chip {kind!r} in topology {topology!r}; known: {', '.join(sorted(CHIPS))}"
        )
    chip = CHIPS[kind]
    if chip.platform == "gpu" and memory_gib is None:
        fraction = gpu_memory_fraction()
        chip = dataclasses.replace(
            chip,
            name=f"{chip.name} ({fraction:.0%} for JAX)",
            memory_bytes=int(chip.memory_bytes * fraction),
        )
    if memory_gib is not None:
        if not 0 < memory_gib < float("inf"):  # NaN fails both comparisons
            raise UsageError(
                f"--memory_gib={memory_gib}: must be a finite number of GiB > 0 (the chip's "
                "memory the plan should assume)"
            )
        chip = dataclasses.replace(
            chip, name=f"{chip.name} ({memory_gib:g} GiB)", memory_bytes=int(memory_gib * GiB)
        )
    return chip


def chip_name_for(device) -> str:
    """The CHIPS key of a real device (for `train_main --sharding_strategy=auto`)."""
    if device.platform == "cpu":
        return "cpu"
    name = peak_name(device.device_kind)
    if name in CHIPS:
        return name
    raise UsageError(
        f"--sharding_strategy=auto has no figures for device kind {device.device_kind!r} "
        f"(known: {', '.join(sorted(CHIPS))}); name a strategy instead"
    )
