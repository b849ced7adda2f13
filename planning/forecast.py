"""The inputs of the step forecast that need a compile: the memory-bound bytes and the kernel
count of the step, from the same step compiled with one and with two unrolled layers
(`planning.estimate`'s module doc says why, and how they combine)."""

from __future__ import annotations

import dataclasses

from planning.hlo_traffic import Traffic

_CACHE: dict = {}


def with_layers(run, layers: int):
    """The run with `layers` layers kept as a Python list (no scan: nothing stacked)."""
    model = dataclasses.replace(run.model, num_layers=layers, scan_layers=False)
    return dataclasses.replace(run, model=model)


def step_traffic(run, candidate, target, compile_traffic) -> Traffic:
    """The L-layer step's traffic from its one- and two-layer versions;
    `compile_traffic(run)` compiles a run for the candidate and target and reads its HLO."""
    layers = run.model.decoder_config().num_layers
    key = (repr(run), candidate, target.name, target.chip)
    if key not in _CACHE:
        one = compile_traffic(with_layers(run, 1))
        two = compile_traffic(with_layers(run, 2)) if layers > 1 else one
        _CACHE[key] = one.extrapolate(two, layers)
    return _CACHE[key]
