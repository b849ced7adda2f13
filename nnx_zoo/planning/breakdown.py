"""A compiled train step's kernels by what they do: GEMMs, attention, the LM head and loss,
norms / rotary / elementwise, the optimizer update, collectives, the rest.

One rule for both views of a step: the compiled program (kernel count and memory-bound bytes
per category, as `planning.hlo_traffic` counts them for the forecast) and a profiler trace
(time per category: each traced kernel is an HLO instruction, `args.hlo_op`, looked up in
the same program's text). The category of a kernel comes from its kind (`hlo_traffic._kind`:
matmul, flash, collective, memory) and the named scopes in its `op_name` metadata, which the
model and the step set: `lm_head` / `lm_head_loss` (zoo/layers/decoder.py), `attention`,
`mlp`, `norm`, `rope` (zoo/layers), `optimizer` (training/loop.py), `embed`.
"""

from __future__ import annotations

import dataclasses
import re

from nnx_zoo.planning import hlo_traffic
from shardings.hlo import _parse

# In the order tables print them.
CATEGORIES = (
    "gemm",
    "attention",
    "lm_head_loss",
    "norm_rotary_elementwise",
    "optimizer",
    "collectives",
    "other",
)
_OP_NAME = re.compile(r'op_name="([^"]*)"')
# A scope is a path component of op_name, possibly wrapped by a transform: `jvp(mlp)/mul`.
_ELEMENTWISE = re.compile(r"\b(norm|rope|mlp)\b")
_ATTENTION = re.compile(r"\battention\b")
_OPTIMIZER = re.compile(r"\boptimizer\b")


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One kernel of a compiled step: its HLO name, category, executions per step and the
    memory-bound bytes it moves per execution (0 for GEMMs, attention kernels, collectives:
    the forecast times those by their FLOPs or links, not by bytes)."""

    name: str
    category: str
    executions: int
    bytes: float


def category(kind: str, op_name: str) -> str:
    """The category of a kernel of `kind` (hlo_traffic's) whose metadata says `op_name`."""
    if kind == "collective":
        return "collectives"
    if "lm_head" in op_name:
        return "lm_head_loss"  # its GEMMs too: the head's cost is one line
    if kind == "flash":
        return "attention"
    if _OPTIMIZER.search(op_name):
        return "optimizer"
    if kind == "matmul":
        return "gemm"
    if _ELEMENTWISE.search(op_name):
        return "norm_rotary_elementwise"
    if _ATTENTION.search(op_name):
        return "attention"  # masks / biases and layout work around the attention kernel
    return "other"  # the embedding, weight casts, residual adds, bookkeeping


def kernels(hlo_text: str) -> list[Kernel]:
    """Every kernel the compiled module runs per step (loop trip counts included)."""
    computations, entry = _parse(hlo_text)
    if entry is None:
        return []
    out = []
    for name, runs in hlo_traffic._device_computations(computations, entry).items():
        body = computations[name]
        shapes = {i.name: i.shape for i in body}
        for inst in body:
            kind = hlo_traffic._kind(inst, computations)
            if kind == "free":
                continue
            match = _OP_NAME.search(inst.attrs)
            size = (
                hlo_traffic._kernel_bytes(inst, shapes, computations) if kind == "memory" else 0.0
            )
            out.append(
                Kernel(inst.name, category(kind, match.group(1) if match else ""), runs, size)
            )
    return out


@dataclasses.dataclass(frozen=True)
class Row:
    """One category's kernels launched and memory-bound bytes moved, per step."""

    kernels: float
    bytes: float

    def __add__(self, other: Row) -> Row:
        return Row(self.kernels + other.kernels, self.bytes + other.bytes)

    def scaled(self, factor: float) -> Row:
        return Row(self.kernels * factor, self.bytes * factor)


def by_category(hlo_text: str) -> dict[str, Row]:
    """category -> Row of one compiled module. Collectives count as kernels here (the
    forecast's kernel count leaves them out: their time is the communication terms')."""
    rows = {c: Row(0, 0.0) for c in CATEGORIES}
    for k in kernels(hlo_text):
        rows[k.category] += Row(k.executions, k.executions * k.bytes)
    return rows


def extrapolate(one: dict[str, Row], two: dict[str, Row], layers: int) -> dict[str, Row]:
    """The L-layer step's rows from its one- and two-layer programs, as the forecast
    extrapolates its totals (`hlo_traffic.Traffic.extrapolate`)."""
    return {c: one[c] + (two[c] + one[c].scaled(-1)).scaled(layers - 1) for c in CATEGORIES}


def instruction_categories(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> category, for the kernels a profiler trace names."""
    return {k.name: k.category for k in kernels(hlo_text)}
