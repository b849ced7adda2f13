"""The step forecast of a compiled plan (`planning.estimate.forecast_step`), with the inputs
that need a compile: the memory-bound bytes and the kernel count of the step, from the same
step compiled with one and with two unrolled layers (`planning.estimate`'s module doc says
why, and how they combine)."""

from __future__ import annotations

import dataclasses

from nnx_zoo.planning.compile import Plan, compile_plan, has_reference
from nnx_zoo.planning.estimate import Forecast, forecast_step
from nnx_zoo.planning.hlo_traffic import Traffic
from shardings import get_strategy

_CACHE: dict = {}


def with_layers(run, layers: int):
    """The run with `layers` layers kept as a Python list (no scan: nothing stacked)."""
    model = dataclasses.replace(run.model, num_layers=layers, scan_layers=False)
    return dataclasses.replace(run, model=model)


def step_traffic(run, candidate, target) -> Traffic:
    """The L-layer step's kernels and memory-bound bytes from its one- and two-layer
    versions, compiled for the same candidate and target."""
    layers = run.model.decoder_config().num_layers
    key = (repr(run), candidate, target.name, len(target.devices))
    if key not in _CACHE:
        one = compile_plan(with_layers(run, 1), candidate, target).traffic
        two = compile_plan(with_layers(run, 2), candidate, target).traffic if layers > 1 else one
        _CACHE[key] = one.extrapolate(two, layers)
    return _CACHE[key]


def _in_stage(candidate):
    """A pipeline candidate's twin without the pipeline: the strategy that runs inside a
    stage (fsdp_pp -> fsdp) on the same devices, `stage` folded into `data`. Per device it
    holds the same bytes of weights, optimizer state and activations (L/S layers sharded
    over N/S devices against L layers over N), so its memory-bound traffic stands for the
    pipeline's, which per-layer twins of one and two layers cannot be cut into stages for."""
    strategy = get_strategy(candidate.strategy)
    inner = candidate.strategy.removesuffix("_pp")
    sizes = dict(zip(strategy.axes, candidate.mesh_shape, strict=True))
    sizes["data"] *= sizes.pop("stage")
    shape = tuple(sizes[a] for a in get_strategy(inner).axes)
    # No pipeline, so no schedule: GPipe's and 1F1B's twins are one compile.
    return dataclasses.replace(candidate, strategy=inner, mesh_shape=shape, pipeline_schedule="")


def add_forecast(run, plan: Plan) -> Forecast | None:
    """Set `plan.forecast` (None on a chip without the figures, e.g. the simulated CPU, and
    for a plan the compiler refused for memory). A pipeline strategy's memory-bound bytes
    come from its in-stage twin (`_in_stage`), and its schedule stretches the layers' time
    by the bubble (`planning.estimate.forecast_step`)."""
    chip = plan.target.chip
    # A plan the compiler refused has no program to read the collectives from.
    if chip.hbm_bytes_per_s is None or plan.compile_error is not None:
        plan.forecast = None
        return None
    twin = plan.candidate if plan.schedule is None else _in_stage(plan.candidate)
    total = step_traffic(run, twin, plan.target)
    e = plan.estimate
    plan.forecast = forecast_step(
        run.model.decoder_config(),
        seq_len=plan.seq_len,
        global_batch=plan.global_batch,
        num_devices=len(plan.target.devices),
        micro_batches=plan.candidate.micro_batches,
        tensor_parallel=plan.mesh.get("model", 1),
        remat=plan.candidate.remat,
        chip=chip,
        flash=plan.traffic is not None and plan.traffic.flash_kernels > 0,
        memory_bytes=total.memory_bytes,
        kernels=total.kernels,
        exposed_comm=e.exposed_comm_seconds,
        overlapped_comm=e.overlapped_comm_seconds,
        pipeline=plan.schedule,
        reference=has_reference(run),
    )
    return plan.forecast
