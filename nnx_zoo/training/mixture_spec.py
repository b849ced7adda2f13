"""`data.mixture`, the string that names a run's weighted sources: `name:source:weight,...`.

Read at config time, so a typo stops the run before anything is built. The rules:
  - components are separated by ',' (so a source cannot contain ',');
  - in each, the name is everything before the first ':' and the weight everything after the
    last ':'; the source is what lies between, so it may itself contain ':'
    (`web:gs://bucket/web/*.arrayrecord:0.3`);
  - a name is letters, digits, '_', '-' and '.', unique in the mixture (metrics.jsonl's
    `tokens/<name>` and the saved position key on it);
  - a source is anything `data.source` accepts ('default', a path, a directory, a glob);
  - a weight is a finite number > 0; the weights are normalized to sum to 1.
docs/data.md#weighted-mixtures has the semantics.
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple

from nnx_zoo.errors import UsageError

_NAME = re.compile(r"[A-Za-z0-9_.\-]+")
FORM = "name:source:weight,name:source:weight,... (e.g. code:/data/code:0.7,web:/data/web:0.3)"


class MixtureComponent(NamedTuple):
    name: str
    source: str
    weight: float  # normalized: the weights of a mixture sum to 1


def _fail(why: str) -> None:
    raise UsageError(f"config data.mixture: {why}")


def parse_mixture(text: str) -> tuple[MixtureComponent, ...]:
    """The components of a `data.mixture` string, weights normalized; () for ''. One-line
    UsageError naming the bad part and the valid form."""
    if not text.strip():
        return ()
    parsed = []
    for part in text.split(","):
        part = part.strip()
        name, _, rest = part.partition(":")
        source, _, weight_text = rest.rpartition(":")
        name, source, weight_text = name.strip(), source.strip(), weight_text.strip()
        if not (name and source and weight_text):
            _fail(f"{part!r} is not name:source:weight; expected {FORM}")
        if not _NAME.fullmatch(name):
            _fail(f"source name {name!r} in {part!r}: use letters, digits, '_', '-', '.'")
        try:
            weight = float(weight_text)
        except ValueError:
            _fail(f"weight {weight_text!r} of {name!r} is not a number; expected {FORM}")
        if not (math.isfinite(weight) and weight > 0):
            _fail(f"weight {weight_text} of {name!r} must be a finite number > 0")
        if any(name == p[0] for p in parsed):
            _fail(f"source name {name!r} appears twice; each component needs its own name")
        parsed.append((name, source, weight))
    total = sum(w for _, _, w in parsed)
    return tuple(MixtureComponent(n, s, w / total) for n, s, w in parsed)


def describe_change(saved: str, new: str) -> tuple[str | None, str | None]:
    """(what makes `new` a different set of sources than `saved`, or None; the weight change,
    or None), both as text for one line. A component is its name and its source."""
    old_parts, new_parts = parse_mixture(saved), parse_mixture(new)
    old_sources = {c.name: c.source for c in old_parts}
    new_sources = {c.name: c.source for c in new_parts}
    if old_sources != new_sources:
        differences = [f"added {n}:{s}" for n, s in new_sources.items() if n not in old_sources]
        differences += [f"removed {n}:{s}" for n, s in old_sources.items() if n not in new_sources]
        differences += [
            f"{n}'s source {old_sources[n]} -> {s}"
            for n, s in new_sources.items()
            if n in old_sources and old_sources[n] != s
        ]
        if not old_parts:
            differences = [f"data.mixture set (the checkpoint's run read data.source): {new}"]
        elif not new_parts:
            differences = [f"data.mixture unset (the checkpoint's run mixed {saved})"]
        return "; ".join(differences), None
    old_weights = {c.name: c.weight for c in old_parts}
    changed = [
        f"{c.name} {old_weights[c.name]:.4g} -> {c.weight:.4g}"
        for c in new_parts
        if not math.isclose(old_weights[c.name], c.weight, rel_tol=1e-9)
    ]
    return None, (", ".join(changed) or None)
