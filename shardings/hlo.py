"""Read a compiled (partitioned) HLO module's text: its collectives, how often each runs per
step, how many bytes each moves and which mesh axes it crosses, and its custom-call kernels.

The spellings differ by backend, and all of them are handled here:
- async pairs (`all-gather-start` / `all-gather-done`, GPU and TPU): counted once, by `-start`;
- ops wrapped in an async computation (`async-start(...), calls=%reduce-scatter...`): found by
  walking into the called computation;
- TPU reduce-scatters emitted as a fusion (`fusion(...), calls=%all-reduce-scatter.N`);
- combined collectives (one op with a tuple of operands, GPU's combiners): one op, bytes summed;
- replica groups as lists (`{{0,1},{2,3}}`), iota (`[2,4]<=[4,2]T(1,0)`) or mesh form
  (`mesh['axis_0'=4,'axis_1'=2] {'axis_1'}`).
An op inside a `while` body (a scanned layer stack) runs once per iteration: its count is
multiplied by the loop's trip count (XLA's `known_trip_count`, else the bound the loop's
condition compares against).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter

import numpy as np

COLLECTIVES = (
    "all-gather",
    "reduce-scatter",
    "all-reduce",
    "all-to-all",
    "ragged-all-to-all",
    "collective-permute",
)
# TPU's fused reduce-scatter: a fusion whose called computation has this name.
_FUSED_REDUCE_SCATTER = "all-reduce-scatter"

_DTYPE_BYTES = {
    "pred": 1,
    "s2": 0.25,
    "u2": 0.25,
    "s4": 0.5,
    "u4": 0.5,
    "f4e2m1fn": 0.5,
    "s8": 1,
    "u8": 1,
    # fp8 (model.quantization=fp8 gathers e4m3 weights and moves e5m2 gradients)
    "f8e3m4": 1,
    "f8e4m3": 1,
    "f8e4m3fn": 1,
    "f8e4m3fnuz": 1,
    "f8e4m3b11fnuz": 1,
    "f8e5m2": 1,
    "f8e5m2fnuz": 1,
    "f8e8m0fnu": 1,
    "bf16": 2,
    "f16": 2,
    "s16": 2,
    "u16": 2,
    "f32": 4,
    "s32": 4,
    "u32": 4,
    "f64": 8,
    "s64": 8,
    "u64": 8,
    "c64": 8,
    "c128": 16,
}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective op of the program, with what a device does per execution."""

    op: str  # one of COLLECTIVES
    name: str  # the HLO instruction's name
    # The whole array in the group: AG output, RS input, AR/A2A/CP operand; for a ragged
    # all-to-all the smaller of operand and output (see `_ragged_bytes`).
    array_bytes: int
    group_size: int  # devices in each replica group (2 for a permute pair)
    axes: tuple[str, ...]  # mesh axes the group spans
    executions: int  # per step: the product of the enclosing loops' trip counts
    dtypes: tuple[str, ...] = ()  # element types of the arrays it moves (`bf16`, `f8e4m3fn`)

    @property
    def bytes_per_device(self) -> float:
        """Bytes each device sends per execution, for ring algorithms on `group_size` devices:
        (n-1)/n of the array for all-gather, reduce-scatter and all-to-all, twice that for
        all-reduce (a reduce-scatter then an all-gather), the whole operand for a permute."""
        n = self.group_size
        if n <= 1:
            return 0.0
        share = self.array_bytes * (n - 1) / n
        if self.op == "all-reduce":
            return 2 * share
        if self.op == "collective-permute":
            return float(self.array_bytes)
        return share


@dataclasses.dataclass
class _Instruction:
    name: str
    shape: str
    opcode: str
    attrs: str


def _split_shape(text: str) -> tuple[str, str]:
    """`(f32[2], s32[]) op(...)` -> (shape, rest): a shape is one token or a balanced tuple."""
    if not text.startswith("("):
        shape, _, rest = text.partition(" ")
        return shape, rest
    depth = 0
    for i, ch in enumerate(text):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            return text[: i + 1], text[i + 1 :].lstrip()
    return text, ""


def _parse(hlo_text: str) -> tuple[dict[str, list[_Instruction]], str | None]:
    """Computations by name (instructions in order), and the entry computation's name."""
    computations: dict[str, list[_Instruction]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        if current is None:
            header = _HEADER.match(line)
            if header and not line.startswith((" ", "\t")):
                current = header.group(1)
                computations[current] = []
                if line.startswith("ENTRY"):
                    entry = current
            continue
        # Only a lone brace closes a computation: a kernel's metadata string can hold a
        # newline, and its continuation line may start with `}}` (splash on TPU does).
        if line.rstrip() == "}":
            current = None
            continue
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        shape, rest = _split_shape(match.group(2))
        opcode, _, attrs = rest.partition("(")
        computations[current].append(_Instruction(match.group(1), shape, opcode.strip(), attrs))
    return computations, entry


def _callees(inst: _Instruction) -> list[tuple[str, str]]:
    """(attribute, computation) pairs this instruction calls."""
    out = [(m.group(1), m.group(2)) for m in re.finditer(r"\b(\w+)=%([\w.\-]+)", inst.attrs)]
    for m in re.finditer(r"\b(branch_computations|called_computations)=\{([^}]*)\}", inst.attrs):
        out += [(m.group(1), c.strip().lstrip("%")) for c in m.group(2).split(",") if c.strip()]
    return out


def _trip_count(inst: _Instruction, computations: dict[str, list[_Instruction]]) -> int:
    known = re.search(r'"known_trip_count":\{"n":"(\d+)"', inst.attrs)
    if known:
        return int(known.group(1))
    condition = dict(_callees(inst)).get("condition")
    bounds = []
    for cond_inst in computations.get(condition, []):
        if cond_inst.opcode == "constant" and re.match(r"^[su](32|64)\[\]", cond_inst.shape):
            value = re.match(r"\s*(-?\d+)\)", cond_inst.attrs)
            if value:
                bounds.append(int(value.group(1)))
    # A scan's condition compares its counter with one constant, the length.
    return bounds[0] if len(bounds) == 1 and bounds[0] > 0 else 1


def _multipliers(computations, entry) -> dict[str, int]:
    """How many times each computation runs per execution of the entry computation."""
    times: dict[str, int] = {entry: 1}
    order = [entry]
    seen = {entry}
    while order:
        name = order.pop(0)
        for inst in computations.get(name, []):
            for attr, callee in _callees(inst):
                if callee not in computations or attr in ("to_apply", "condition"):
                    continue
                if callee.startswith(_FUSED_REDUCE_SCATTER):
                    continue  # counted as one reduce-scatter at the fusion that calls it
                factor = _trip_count(inst, computations) if attr == "body" else 1
                times[callee] = times.get(callee, 0) + times[name] * factor
                if callee not in seen:
                    seen.add(callee)
                    order.append(callee)
    return times


def _arrays_bytes(shape_text: str) -> int:
    total = 0.0
    for dtype, dims in _ARRAY.findall(shape_text):
        size = _DTYPE_BYTES.get(dtype)
        if size is None:
            continue
        total += size * math.prod(int(d) for d in dims.split(",") if d)
    return int(total)


def _top_level(shape_text: str) -> list[str]:
    """Elements of a tuple shape `(a, (b, c), d)`; a non-tuple shape is its own element."""
    if not shape_text.startswith("("):
        return [shape_text]
    parts, depth, braces, start = [], 0, 0, 1
    for i, ch in enumerate(shape_text):
        if ch in "{}[]":  # dims `[8,2]` and layouts `{1,0}` hold commas too
            braces += 1 if ch in "{[" else -1
        elif ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth == 0:
                parts.append(shape_text[start:i])
        elif ch == "," and depth == 1 and braces == 0:
            parts.append(shape_text[start:i])
            start = i + 1
    return [p.strip() for p in parts if p.strip()]


def _output_shape(op: str, is_start: bool, shape_text: str) -> str:
    # An async start returns (operands, results, context...). all-reduce-start returned the
    # reduced value(s) itself up to jax 0.10's XLA (`f32[8]`, or a combined op's tuple
    # `(f32[8], f32[4])`); newer XLA wraps it like the others: `((f32[8]), f32[8])`.
    if is_start:
        elements = _top_level(shape_text)
        if op != "all-reduce" and len(elements) >= 2:
            return elements[1]
        if op == "all-reduce" and len(elements) == 2 and elements[0].startswith("("):
            return elements[1]
    return shape_text


def _iota(text: str) -> np.ndarray:
    """HLO's iota list `[2,4]<=[4,2]T(1,0)`: iota over the dims after `<=`, transposed,
    reshaped to the dims before it (`[8]` alone: 0..7)."""
    m = re.match(r"\[([\d,]+)\](?:<=\[([\d,]+)\])?(?:T\(([\d,]+)\))?", text.strip())
    shape = [int(x) for x in m.group(1).split(",")]
    dims = [int(x) for x in (m.group(2) or m.group(1)).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if m.group(3):
        ids = np.transpose(ids, [int(x) for x in m.group(3).split(",")])
    return ids.reshape(shape)


def _groups(attrs: str, num_devices: int) -> list[list[int]]:
    """Replica groups (or permute pairs) as lists of device ids in the mesh's flat order."""
    pairs = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", attrs)
    if pairs:
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs.group(1))]
    mesh_form = re.search(
        r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(([^)]*\)?)\))?\s*\{([^}]*)\}", attrs
    )
    if mesh_form:
        dims = [(n, int(s)) for n, s in re.findall(r"'([^']+)'=(\d+)", mesh_form.group(1))]
        grouped = re.findall(r"'([^']+)'", mesh_form.group(3))
        names = [n for n, _ in dims]
        size = math.prod(s for _, s in dims)
        # Mesh positions hold device ids in iota order, or as `device_ids=(...)` permutes them.
        ids = _iota(mesh_form.group(2)) if mesh_form.group(2) else np.arange(size)
        ids = np.asarray(ids).reshape([s for _, s in dims])
        kept = [i for i, n in enumerate(names) if n not in grouped]
        moved = [names.index(n) for n in grouped]
        size = math.prod(dims[i][1] for i in moved)
        return np.transpose(ids, kept + moved).reshape(-1, size).tolist()
    iota = re.search(r"replica_groups=(\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?)", attrs)
    if iota:
        ids = _iota(iota.group(1))
        return ids.reshape(ids.shape[0], -1).tolist()
    listed = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", attrs)
    if listed and listed.group(1):
        return [
            [int(x) for x in g.split(",") if x]
            for g in re.findall(r"\{([\d,]*)\}", listed.group(1))
        ]
    return [list(range(num_devices))]  # `{}` or no groups: every device


def _axes_crossed(groups, mesh_shape: dict[str, int]) -> tuple[str, ...]:
    names, sizes = list(mesh_shape), list(mesh_shape.values())
    total = math.prod(sizes)
    crossed = set()
    for group in groups:
        coords = np.array([np.unravel_index(d % total, sizes) for d in group])
        for i, name in enumerate(names):
            if len(coords) and len(set(coords[:, i].tolist())) > 1:
                crossed.add(name)
    return tuple(n for n in names if n in crossed)


def collectives(hlo_text: str, mesh_shape: dict[str, int] | None = None) -> list[Collective]:
    """Every collective of a compiled module, with per-step executions and axes crossed.

    `mesh_shape` is the mesh the program was partitioned over (`dict(mesh.shape)`, in axis
    order): device ids in replica groups index its devices in flat (row-major) order. Without
    it, axes are left empty.
    """
    computations, entry = _parse(hlo_text)
    if entry is None:
        return []
    times = _multipliers(computations, entry)
    shapes = {name: {i.name: i.shape for i in insts} for name, insts in computations.items()}
    num_devices = math.prod(mesh_shape.values()) if mesh_shape else 0
    out = []
    for comp_name, instructions in computations.items():
        runs = times.get(comp_name, 0)
        if runs == 0:
            continue
        for inst in instructions:
            op, is_start = inst.opcode, False
            if op.endswith("-start") and op.removesuffix("-start") in COLLECTIVES:
                op, is_start = op.removesuffix("-start"), True
            elif op == "fusion" and re.search(rf"calls=%{_FUSED_REDUCE_SCATTER}\b", inst.attrs):
                op = "reduce-scatter"
            elif op not in COLLECTIVES:
                continue
            groups = _groups(_group_attrs(inst, computations), num_devices)
            group_size = max(len(g) for g in groups) if groups else 1
            output_shape = _output_shape(op, is_start, inst.shape)
            output = _arrays_bytes(output_shape)
            array = output * group_size if op == "reduce-scatter" else output
            if op == "ragged-all-to-all":
                array = _ragged_bytes(inst, output, shapes[comp_name])
            axes = _axes_crossed(groups, mesh_shape) if mesh_shape else ()
            dtypes = tuple(sorted({dtype for dtype, _ in _ARRAY.findall(output_shape)}))
            out.append(Collective(op, inst.name, array, group_size, axes, runs, dtypes))
    return out


def _group_attrs(inst: _Instruction, computations) -> str:
    """The attributes that name `inst`'s replica groups: its own, or for TPU's fused
    reduce-scatter (whose fusion line names none) those of the all-reduce it calls."""
    called = re.search(rf"calls=%({_FUSED_REDUCE_SCATTER}[\w.\-]*)", inst.attrs)
    if inst.opcode != "fusion" or not called:
        return inst.attrs
    for inner in computations.get(called.group(1), []):
        if inner.opcode in ("all-reduce", "all-reduce-start"):
            return inner.attrs
    return inst.attrs


def _ragged_bytes(inst: _Instruction, output: int, shapes: dict[str, str]) -> int:
    """A ragged all-to-all sends slices of its operand into a preallocated output, so its
    buffers bound the bytes: a device sends at most its operand and receives at most its
    output, and what the group sends it receives, so the mean per device is at most the
    smaller of the two. An MoE dispatch fills its whole operand (every routed row is sent)
    and its combine fills its whole output, so there the bound is the bytes moved."""
    first = re.match(r"\s*%?([\w.\-]+)", inst.attrs)
    operand = shapes.get(first.group(1)) if first else None
    return min(output, _arrays_bytes(operand)) if operand else output


def kernels(hlo_text: str) -> Counter:
    """Custom-call targets (Pallas / Mosaic kernels, cuDNN fused attention, ...) -> count."""
    return Counter(re.findall(r'custom_call_target="([^"]+)"', hlo_text))


# An array whose layout names memory space 5, XLA's host memory space (pinned host, where
# remat='offload' sends activations): `bf16[2,128,64]{1,2,0:T(8,128)(2,1)S(5)}`.
_HOST_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]\{[^}]*\bS\(5\)\}")


def host_arrays(hlo_text: str) -> list[str]:
    """The distinct arrays (`dtype[dims]`, sorted) that live in host memory in the module."""
    return sorted({f"{dtype}[{dims}]" for dtype, dims in _HOST_ARRAY.findall(hlo_text)})


# Custom calls that are matrix multiplies: cuBLAS / cuBLASLt GEMMs on GPU (`__cublas$gemm`,
# `__cublas$lt$matmul`, `__cublas$lt$matmul$f8`), which XLA GPU rewrites most dots into.
_GEMM_TARGET = re.compile(r'custom_call_target="([^"]*(?:gemm|matmul)[^"]*)"', re.IGNORECASE)


def _operand_dtypes(inst: _Instruction, shapes: dict[str, str]) -> list[str]:
    """Dtypes of an instruction's operands, in order: printed beside each operand in compiled
    HLO (`dot(bf16[8,64]{1,0} %a, ...)`), else looked up by the operand's name."""
    depth, end = 1, len(inst.attrs)
    for i, ch in enumerate(inst.attrs):
        depth += (ch == "(") - (ch == ")")
        if depth == 0:
            end = i
            break
    out = []
    for operand in re.split(r",\s*(?![^\[\{]*[\]\}])", inst.attrs[:end]):
        typed = _ARRAY.match(operand.strip())
        if typed:
            out.append(typed.group(1))
            continue
        name = operand.strip().lstrip("%")
        shape = _ARRAY.match(shapes.get(name, ""))
        out.append(shape.group(1) if shape else "?")
    return out


def dot_dtypes(hlo_text: str) -> Counter:
    """Matrix multiplies by operand dtypes -> count: `dot`s and `convolution`s (also inside
    fusions: TPU's output fusions, GPU's Triton GEMMs) and GEMM custom calls, keyed
    `"lhs x rhs"`, e.g. `{"f8e4m3fn x f8e4m3fn": 42, "bf16 x bf16": 6}`. Instructions of the
    compiled module, each counted once (a scanned layer stack's body once, not once per layer).
    A missing low-precision path shows as the absence of its dtypes."""
    computations, entry = _parse(hlo_text)
    if entry is None:
        return Counter()
    live = _multipliers(computations, entry)
    out: Counter = Counter()
    for name, instructions in computations.items():
        if not live.get(name):
            continue
        shapes = {inst.name: inst.shape for inst in instructions}
        for inst in instructions:
            gemm = inst.opcode == "custom-call" and _GEMM_TARGET.search(inst.attrs)
            if inst.opcode not in ("dot", "convolution") and not gemm:
                continue
            dtypes = _operand_dtypes(inst, shapes)
            out[" x ".join(dtypes[:2])] += 1
    return out
