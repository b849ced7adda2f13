"""Read what a strategy declared and what XLA did with it: layout tables and collectives.

Works on plain data (path, shape, spec rows; compiled HLO text), so it needs no model
family: `explain_main.py` feeds it from the zoo.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter

import numpy as np
from jax.sharding import PartitionSpec as P

from shardings.hlo import COLLECTIVES, collectives
from shardings.specs import axes_of, normalize


def dims_text(shape: tuple[int, ...], spec: P, letters: str | None = None) -> str:
    """`(2, 64, 8, 16)` + `P(None, 'data', 'model')` -> `2 64/data 8/model 16`."""
    entries = tuple(normalize(spec, len(shape)))
    parts = []
    for i, (size, axes) in enumerate(zip(shape, entries, strict=True)):
        name = letters[i] if letters and i < len(letters) else str(size)
        if axes is None:
            parts.append(name)
        else:
            parts.append(f"{name}/{'+'.join(axes_of(axes))}")
    return " ".join(parts)


def layout_table(rows_by_strategy: dict[str, list[tuple[str, tuple[int, ...], P]]]) -> str:
    """One line per parameter, one column per strategy."""
    names = list(rows_by_strategy)
    first = rows_by_strategy[names[0]]
    by_name = {n: {path: (shape, spec) for path, shape, spec in rows_by_strategy[n]} for n in names}
    header = ["parameter", "shape", *names]
    lines = [header]
    for path, shape, _ in first:
        cells = [path, "x".join(map(str, shape))]
        for n in names:
            s, spec = by_name[n][path]
            cells.append(dims_text(s, spec))
        lines.append(cells)
    widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
    out = []
    for j, row in enumerate(lines):
        out.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
        if j == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def count_collectives(hlo_text: str) -> Counter:
    """Collective ops in compiled (partitioned) HLO, each op once however it is spelt (async
    `-start`/`-done` pairs, TPU's fused reduce-scatters); `shardings.hlo.collectives` has
    executions per step, bytes and mesh axes."""
    counts: Counter = Counter({op: 0 for op in COLLECTIVES})
    counts.update(c.op for c in collectives(hlo_text))
    return counts


def declared_specs(sharding, prefix: str = "") -> list[tuple[str, P]]:
    """Every spec in a sharding dataclass tree, as (dotted field path, spec), in field order."""
    rows = []
    for field in dataclasses.fields(sharding):
        value = getattr(sharding, field.name)
        path = f"{prefix}{field.name}"
        if dataclasses.is_dataclass(value):
            rows.extend(declared_specs(value, f"{path}."))
        else:
            rows.append((path, value))
    return rows


def layout_report(name: str, param_rows: list[tuple[str, tuple[int, ...], P]], sharding) -> str:
    """One strategy's parameter table and every declared spec: the golden-file text, whose
    diff shows a layout change in review."""
    specs = declared_specs(sharding)
    width = max(len(path) for path, _ in specs)
    lines = [layout_table({name: param_rows}), "", "declared specs:"]
    lines += [f"{path.ljust(width)}  {spec}" for path, spec in specs]
    return "\n".join(lines) + "\n"


# -- which collectives cross slices (DCN) -------------------------------------------------------

_OP_RE = re.compile(
    r"= [^=]*?\b(" + "|".join(COLLECTIVES) + r")(-start)?\((?P<rest>.*)$", re.MULTILINE
)
_IOTA_RE = re.compile(r"\[([\d,]+)\](?:<=\[([\d,]+)\])?(?:T\(([\d,]+)\))?")


def _iota_ids(text: str) -> np.ndarray:
    """`[2,4]T(1,0)` or `[8]<=[2,4]T(1,0)`: iota, reshaped, transposed, as HLO writes it."""
    m = _IOTA_RE.match(text)
    shape = [int(v) for v in m.group(1).split(",")]
    dims = [int(v) for v in (m.group(2) or m.group(1)).split(",")]
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if m.group(3):
        ids = ids.transpose([int(v) for v in m.group(3).split(",")])
    return ids.reshape(shape) if m.group(2) else ids


def _groups(rest: str) -> list[list[int]] | None:
    """The device groups of one collective (source-target pairs for a permute), or None when
    the HLO names none (every device in one group)."""
    pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", rest)
    if pairs:
        return [
            [int(v) for v in p.split(",")]
            for p in re.findall(r"\{([\d,]+)\}", pairs.group(1) + "}")
        ]
    mesh = re.search(
        r"replica_groups=mesh\[([^\]]*)\](?:, device_ids=\((.*?)\))? \{([^}]*)\}", rest
    )
    if mesh:
        axes = re.findall(r"'([^']+)'=(\d+)", mesh.group(1))
        names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
        ids = _iota_ids(mesh.group(2)) if mesh.group(2) else np.arange(int(np.prod(sizes)))
        ids = ids.reshape(sizes)
        over = [names.index(a) for a in re.findall(r"'([^']+)'", mesh.group(3))]
        keep = [i for i in range(len(sizes)) if i not in over]
        ids = ids.transpose(keep + over).reshape(-1, int(np.prod([sizes[i] for i in over])))
        return ids.tolist()
    iota = re.search(r"replica_groups=(\[[\d,]+\](?:<=\[[\d,]+\])?(?:T\([\d,]+\))?)", rest)
    if iota:
        return _iota_ids(iota.group(1)).tolist()
    explicit = re.search(r"replica_groups=\{(.*?)\}\}", rest)
    if explicit:
        return [
            [int(v) for v in g.split(",")]
            for g in re.findall(r"\{([\d,]*)\}", explicit.group(1) + "}")
            if g
        ]
    return None


def count_collectives_by_link(hlo_text: str, slice_of: list[int]) -> Counter:
    """Collectives keyed (op, 'dcn' | 'ici'): 'dcn' when one of its groups (or permute pairs)
    joins devices of different slices. `slice_of[p]` is the slice of partition p, the p-th
    device of the mesh in order (`mesh.devices.flat`)."""
    counts: Counter = Counter()
    for m in _OP_RE.finditer(hlo_text):
        groups = _groups(m.group("rest"))
        if groups is None:
            groups = [list(range(len(slice_of)))]
        crosses = any(len({slice_of[d] for d in g}) > 1 for g in groups)
        counts[(m.group(1), "dcn" if crosses else "ici")] += 1
    return counts
