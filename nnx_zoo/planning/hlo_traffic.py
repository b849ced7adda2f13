"""What a compiled step's kernels do, by kind, from its optimized HLO text: the HBM bytes of the
memory-bound kernels, and how many kernels run, per step (loop trip counts included).

A kernel is a top-level instruction of a computation that runs on the device (the entry, a
`while` body, a conditional's branch, a `call`'s callee); a fusion's fused computation is one
kernel, not many. Each kernel is one of:

- matmul: a `dot` / `convolution`, a fusion that contains one (TPU's and GPU's output fusions,
  Triton GEMMs), or a GEMM custom call (cuBLAS). Its time is the step model's matmul term, so
  its bytes are not counted here (a large matmul is compute-bound, its bytes hide);
- flash: an attention kernel custom call (cuDNN fused attention, TPU Pallas/Mosaic kernels);
  timed by the flash term;
- collective: timed by the communication terms;
- free: bookkeeping with no data movement (parameter, constant, tuple, get-tuple-element,
  bitcast, the `while` / `call` / `conditional` themselves, async `-done` halves);
- memory: everything else (elementwise fusions, reductions, norms, rotary, softmax outside a
  flash kernel, the optimizer update, the loss, copies and transposes). Its bytes are what it
  reads plus what it writes, with two corrections for in-place updates of a stacked buffer:
  a fusion rooted at a `dynamic-update-slice` writes only the update (its aliased operand is
  neither read nor written in full; an update computed inside the fusion is not read), and
  an operand read only through `dynamic-slice` / `slice` costs the slice, not the stack.
"""

from __future__ import annotations

import dataclasses
import re

from shardings.hlo import COLLECTIVES, _arrays_bytes, _callees, _parse, _trip_count

FREE = {
    "parameter",
    "constant",
    "tuple",
    "get-tuple-element",
    "bitcast",
    "while",
    "call",
    "conditional",
    "after-all",
    "partition-id",
    "replica-id",
    "opt-barrier",
    "add-dependency",
    "async-done",
    "async-update",
    "copy-done",
    "send-done",
    "recv-done",
}
MATMUL_OPS = ("dot", "convolution")
# Custom-call targets: GEMM libraries (matmul) and attention kernels (flash).
_GEMM_TARGET = re.compile(r"gemm|matmul|cublas", re.IGNORECASE)
_FLASH_TARGET = re.compile(r"fmha|flash|tpu_custom_call|mosaic|splash", re.IGNORECASE)
_OPERAND = re.compile(r"%([\w.\-]+)")


@dataclasses.dataclass(frozen=True)
class Traffic:
    """Per step: bytes moved by memory-bound kernels, and kernels launched, by kind."""

    memory_bytes: float = 0.0
    memory_kernels: int = 0
    matmul_kernels: int = 0
    flash_kernels: int = 0
    collective_kernels: int = 0

    @property
    def kernels(self) -> int:
        return self.memory_kernels + self.matmul_kernels + self.flash_kernels

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(*(a + b for a, b in zip(_values(self), _values(other), strict=True)))

    def scale(self, factor: float) -> Traffic:
        return Traffic(*(a * factor for a in _values(self)))

    def extrapolate(self, two: Traffic, layers: int) -> Traffic:
        """From a one-layer program (self) and a two-layer one: the L-layer program's, as
        one layer's share (two - one) times L plus the rest (one - that share)."""
        per_layer = [b - a for a, b in zip(_values(self), _values(two), strict=True)]
        return Traffic(
            *(a + (layers - 1) * d for a, d in zip(_values(self), per_layer, strict=True))
        )


def _values(t: Traffic) -> list[float]:
    return [getattr(t, f.name) for f in dataclasses.fields(t)]


def _operands(attrs: str) -> list[str]:
    """Operand names of an instruction: the %names before its argument list closes."""
    depth = 1
    for i, ch in enumerate(attrs):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            return _OPERAND.findall(attrs[:i])
    return _OPERAND.findall(attrs)


def _custom_target(attrs: str) -> str:
    m = re.search(r'custom_call_target="([^"]+)"', attrs)
    return m.group(1) if m else ""


def _kind(inst, computations) -> str:
    op = inst.opcode
    base = op.removesuffix("-start").removesuffix("-done")
    if base in COLLECTIVES or (op == "fusion" and "all-reduce-scatter" in inst.attrs):
        return "collective"
    if op in FREE or op.endswith("-done"):
        return "free"
    if op == "async-start":
        called = dict(_callees(inst)).get("calls", "")
        inner = [i.opcode for i in computations.get(called, [])]
        if any(o in COLLECTIVES for o in inner):
            return "collective"
        if any(o in MATMUL_OPS for o in inner):
            return "matmul"
        return "memory"
    if op in MATMUL_OPS:
        return "matmul"
    if op == "custom-call":
        target = _custom_target(inst.attrs)
        if _FLASH_TARGET.search(target):
            return "flash"
        if _GEMM_TARGET.search(target):
            return "matmul"
        return "memory"
    if op == "fusion":
        called = dict(_callees(inst)).get("calls", "")
        body = computations.get(called, [])
        if any(i.opcode in MATMUL_OPS for i in body):
            return "matmul"
        if any(
            i.opcode == "custom-call" and _GEMM_TARGET.search(_custom_target(i.attrs)) for i in body
        ):
            return "matmul"
        return "memory"
    return "memory"


def _fusion_bytes(inst, shapes: dict[str, str], computations) -> float:
    """Bytes a fusion reads and writes, with the in-place and sliced-read corrections."""
    called = dict(_callees(inst)).get("calls", "")
    body = computations.get(called, [])
    operands = _operands(inst.attrs)
    params: dict[int, str] = {}
    for i in body:
        if i.opcode == "parameter":
            m = re.match(r"\s*(\d+)\)", i.attrs)
            if m:
                params[int(m.group(1))] = i.name
    users: dict[str, list] = {}
    for i in body:
        for name in _operands(i.attrs):
            users.setdefault(name, []).append(i)
    root = body[-1] if body else None  # XLA prints a computation's ROOT last
    in_place = root is not None and root.opcode == "dynamic-update-slice"
    out_bytes = _arrays_bytes(inst.shape)
    total = 0.0
    for index, name in enumerate(operands):
        size = _arrays_bytes(shapes.get(name, ""))
        param = params.get(index)
        uses = users.get(param, []) if param else []
        sliced = [
            u
            for u in uses
            if u.opcode in ("dynamic-slice", "slice") and _operands(u.attrs)[0] == param
        ]
        if uses and len(sliced) == len(uses):
            size = sum(_arrays_bytes(u.shape) for u in uses)
        elif (
            in_place
            and size == out_bytes
            and root in uses
            and _operands(root.attrs)[0] == param
            and len(sliced) == len(uses) - 1
        ):
            # The aliased buffer, updated in place; what else reads it reads slices (a
            # read-modify-write of one tile: out[i] = out[i] + y), which cost their size.
            size = sum(_arrays_bytes(u.shape) for u in sliced)
            out_bytes = 0.0
        total += size
    if in_place and out_bytes == 0.0:
        update = _operands(root.attrs)[1:2]
        total += sum(_arrays_bytes(_shape_in(body, u)) for u in update)  # written once
    return total + out_bytes


def _shape_in(body, name: str) -> str:
    for i in body:
        if i.name == name:
            return i.shape
    return ""


def _kernel_bytes(inst, shapes: dict[str, str], computations) -> float:
    if inst.opcode == "fusion":
        return _fusion_bytes(inst, shapes, computations)
    operands = _operands(inst.attrs)
    if inst.opcode == "dynamic-update-slice" and len(operands) >= 2:
        return 2.0 * _arrays_bytes(shapes.get(operands[1], ""))
    if inst.opcode in ("dynamic-slice", "slice"):
        return 2.0 * _arrays_bytes(inst.shape)
    return _arrays_bytes(inst.shape) + sum(_arrays_bytes(shapes.get(n, "")) for n in operands)


def _device_computations(computations, entry) -> dict[str, int]:
    """Computations that run as sequences of kernels -> executions per step."""
    times = {entry: 1}
    order = [entry]
    while order:
        name = order.pop(0)
        for inst in computations.get(name, []):
            if inst.opcode not in ("while", "call", "conditional"):
                continue
            for attr, callee in _callees(inst):
                if callee not in computations or attr == "condition":
                    continue
                if inst.opcode == "call" and attr != "to_apply":
                    continue
                factor = _trip_count(inst, computations) if attr == "body" else 1
                times[callee] = times.get(callee, 0) + times[name] * factor
                order.append(callee)
    return times


def traffic(hlo_text: str) -> Traffic:
    """The per-step kernel counts and memory-bound bytes of a compiled module's text."""
    computations, entry = _parse(hlo_text)
    if entry is None:
        return Traffic()
    counts = {"memory": 0, "matmul": 0, "flash": 0, "collective": 0}
    memory_bytes = 0.0
    for name, runs in _device_computations(computations, entry).items():
        body = computations[name]
        shapes = {i.name: i.shape for i in body}
        for inst in body:
            kind = _kind(inst, computations)
            if kind == "free":
                continue
            counts[kind] += runs
            if kind == "memory":
                memory_bytes += runs * _kernel_bytes(inst, shapes, computations)
    return Traffic(
        memory_bytes=memory_bytes,
        memory_kernels=counts["memory"],
        matmul_kernels=counts["matmul"],
        flash_kernels=counts["flash"],
        collective_kernels=counts["collective"],
    )
