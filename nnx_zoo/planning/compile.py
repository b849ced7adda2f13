"""Compile the product's train step for a target without its hardware, and read the result.

The step is built by the one assembly train_main uses (`launch.build`, abstract): the same
model, optimizer, micro-batches, remat and loss chunking, with every array a
`jax.ShapeDtypeStruct` carrying its `NamedSharding` on the target's mesh, so nothing is
allocated. Its memory figures come from `training.step_memory`, as run_info.json's do.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from typing import NamedTuple

import jax
import numpy as np
from flax import nnx

from nnx_zoo.launch.build import build
from nnx_zoo.planning.chips import Chip, chip_for
from nnx_zoo.planning.estimate import (
    Forecast,
    StepEstimate,
    axis_bandwidth,
    comm_seconds,
    estimate_step,
)
from nnx_zoo.planning.hlo_traffic import Traffic, traffic
from nnx_zoo.planning.targets import TargetError, target_devices
from nnx_zoo.training import finetune, preference
from nnx_zoo.training.step_memory import StepMemory, step_memory
from shardings import get_strategy, hlo
from zoo.layers import pipeline


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One point of the search: a layout, a mesh for it, a remat policy, micro-batches."""

    strategy: str
    mesh_shape: tuple[int, ...]
    remat: str
    micro_batches: int
    # Pipeline strategies: the micro-batches the pipeline cuts each forward pass into, as
    # `auto` chose them (`planning.search.pipeline_microbatches`); 0: the config's.
    pipeline_microbatches: int = 0
    # Pipeline strategies: the schedule (gpipe | 1f1b), as `auto` chose it; "": the config's.
    pipeline_schedule: str = ""
    # Strategies that split T over `context`: how attention sees the keys ('all_gather' or
    # 'ring', model.context_parallel); '' for the others.
    context_parallel: str = ""

    def describe(self) -> str:

        axes = get_strategy(self.strategy).axes
        mesh = ",".join(f"{a}:{n}" for a, n in zip(axes, self.mesh_shape, strict=True))
        text = f"{self.strategy} mesh {mesh} remat={self.remat} micro_batches={self.micro_batches}"
        if self.pipeline_microbatches:
            text += f" pipeline_microbatches={self.pipeline_microbatches}"
        if self.pipeline_schedule:
            text += f" pipeline_schedule={self.pipeline_schedule}"
        if self.context_parallel:
            text += f" context_parallel={self.context_parallel}"
        return text


@dataclasses.dataclass(frozen=True)
class Target:
    """Where the step would run: a name, its devices (abstract or real) and its chip."""

    name: str
    devices: tuple
    chip: Chip

    @property
    def physical_dims(self) -> tuple[int, ...] | None:
        """A TPU slice's chips per dim (`v5p:4x4x4` -> (4, 4, 4)); None for others."""
        if self.chip.platform != "tpu" or ":" not in self.name:
            return None
        return tuple(int(x) for x in self.name.split(":", 1)[1].split("x"))


@dataclasses.dataclass(frozen=True)
class StateBytes:
    """Per-device bytes of the training state, from the layouts."""

    params: int
    optimizer: int
    gradients: int
    largest_params: tuple[tuple[str, int], ...]  # (path, bytes per device), largest first


@dataclasses.dataclass
class Plan:
    """Everything the planner reports for one candidate on one target."""

    candidate: Candidate
    target: Target
    mesh: dict[str, int]
    global_batch: int
    seq_len: int
    state: StateBytes
    memory: StepMemory  # the compiled step's, as run_info.json records it
    compile_seconds: float
    estimate: StepEstimate  # the bound
    # Read from the compiled program (none when the compiler refused it, `compile_error`).
    host_arrays: list[str] = dataclasses.field(default_factory=list)  # in host memory (hlo)
    collectives: list[hlo.Collective] = dataclasses.field(default_factory=list)
    kernels: dict[str, int] = dataclasses.field(default_factory=dict)
    traffic: Traffic | None = None  # this program's kernels and memory-bound bytes
    # What a real step should take (planning.estimate), set by planning.forecast.add_forecast.
    forecast: Forecast | None = None
    # MoE with an expert axis: the token exchange's bytes against the routed payload.
    moe: dict = dataclasses.field(default_factory=dict)
    dot_dtypes: dict[str, int] = dataclasses.field(default_factory=dict)  # hlo.dot_dtypes
    schedule: pipeline.PipelinePlan | None = None  # a pipeline strategy's
    # The compiler's refusal (TPU: temporaries over the chip's HBM); such a plan never fits.
    compile_error: str | None = None

    def __getattr__(self, name: str):
        # argument_bytes, temp_bytes, peak_bytes, host_temp_bytes, required_bytes, ...
        if name.endswith("_bytes") and name != "memory":
            return getattr(self.memory, name)
        raise AttributeError(name)

    @property
    def fits(self) -> bool:
        return self.compile_error is None and self.required_bytes <= self.target.chip.memory_bytes

    @property
    def predicted_from(self) -> str:
        """'forecast' where one was made (TPU / GPU targets), else 'bound'."""
        return "forecast" if self.forecast is not None else "bound"

    @property
    def predicted(self) -> Forecast | StepEstimate:
        """What the plan says a step takes: the forecast, or the bound where there is none."""
        return self.forecast if self.forecast is not None else self.estimate

    def to_json(self) -> dict:
        c = self.candidate
        return {
            "strategy": c.strategy,
            "mesh": self.mesh,
            "topology": self.target.name,
            "remat": c.remat,
            "micro_batches": c.micro_batches,
            "context_parallel": c.context_parallel or None,
            "global_batch": self.global_batch,
            "seq_len": self.seq_len,
            "param_bytes": self.state.params,
            "optimizer_bytes": self.state.optimizer,
            "gradient_bytes": self.state.gradients,
            "largest_params": [list(p) for p in self.state.largest_params],
            **self.memory.to_json(),
            "memory_bytes": self.target.chip.memory_bytes,
            "fits": self.fits,
            "collectives": collective_counts(self.collectives),
            "collective_bytes": collective_bytes(self.collectives),
            # MoE token exchange, dense and ragged together.
            "all_to_all_bytes": sum(
                b for op, b in collective_bytes(self.collectives).items() if "all-to-all" in op
            ),
            **self.moe,
            "collectives_by_axis": collectives_by_axis(self.collectives),
            "kernels": self.kernels,
            "dot_dtypes": self.dot_dtypes,
            "compile_seconds": round(self.compile_seconds, 2),
            "compile_error": self.compile_error,
            "model_flops_per_device": self.estimate.model_flops,
            "executed_flops_per_device": self.estimate.executed_flops,
            "compute_seconds": self.estimate.compute_seconds,
            "exposed_comm_seconds": self.estimate.exposed_comm_seconds,
            "overlapped_comm_seconds": self.estimate.overlapped_comm_seconds,
            # What a step should take: the forecast where there is one, else the bound
            # (`predicted_from` says which: no forecast on the simulated CPU, nor for a
            # plan the compiler refused).
            "predicted_step_seconds": self.predicted.step_seconds,
            "predicted_mfu": self.predicted.mfu,
            "predicted_mfu_at_precision": self.predicted.mfu_at_precision,
            "predicted_from": self.predicted_from,
            # Pipeline strategies: (S-1)/(micro-batches*repeats + S-1); 0 for the others.
            "pipeline_bubble": self.estimate.bubble,
            "pipeline_microbatches": self.schedule.microbatches if self.schedule else None,
            # gpipe | circular | 1f1b, and the micro-batches whose saved activations a
            # device holds at the peak: Mb*R + S-1, or 2S-1 under 1F1B.
            "pipeline_schedule": self.schedule.schedule if self.schedule else None,
            "pipeline_in_flight": self.schedule.in_flight if self.schedule else None,
            # The bound: compute at peak plus the communication it cannot hide.
            "bound_step_seconds": self.estimate.step_seconds,
            "bound_mfu": self.estimate.mfu,
            "bound_mfu_at_precision": self.estimate.mfu_at_precision,
        } | (self.forecast.to_json() if self.forecast else {"forecast_step_seconds": None})


def collective_counts(ops) -> dict[str, int]:
    """op -> executions per step."""
    out: dict[str, int] = {}
    for op in ops:
        out[op.op] = out.get(op.op, 0) + op.executions
    return dict(sorted(out.items()))


def collective_bytes(ops) -> dict[str, int]:
    """op -> array bytes moved per step (summed over executions), per device's group."""
    out: dict[str, int] = {}
    for op in ops:
        out[op.op] = out.get(op.op, 0) + op.executions * op.array_bytes
    return dict(sorted(out.items()))


def collectives_by_axis(ops) -> list[dict]:
    """One row per (op, axes crossed): executions and array bytes per step."""
    rows: dict[tuple, list[int]] = {}
    for op in ops:
        key = (op.op, "+".join(op.axes) or "-")
        row = rows.setdefault(key, [0, 0])
        row[0] += op.executions
        row[1] += op.executions * op.array_bytes
    return [
        {"op": op, "axes": axes, "count": n, "bytes": b}
        for (op, axes), (n, b) in sorted(rows.items())
    ]


def make_target(name: str, memory_gib: float | None = None) -> Target:
    """A target by name: a TPU slice or GPU hosts (`planning.targets`), or `cpu:N`, this
    host's first N (simulated) CPU devices. Raises UsageError (TargetError) with one line."""

    kind, _, count = name.partition(":")
    if kind.lower() == "cpu":
        available = jax.devices("cpu")
        if not count.isdigit() or not 1 <= int(count) <= len(available):
            raise TargetError(
                f"target {name!r}: this host has {len(available)} CPU devices; valid: "
                f"cpu:1 .. cpu:{len(available)} (XLA_FLAGS="
                f"--xla_force_host_platform_device_count=N set before start-up simulates N)"
            )
        devices = tuple(available[: int(count)])
    else:
        devices = tuple(target_devices(name))
    return Target(name=name, devices=devices, chip=chip_for(name, memory_gib))


def _shard_bytes(leaf) -> int:
    sharding = getattr(leaf, "sharding", None)
    shape = sharding.shard_shape(leaf.shape) if sharding is not None else leaf.shape
    return math.prod(shape) * np.dtype(leaf.dtype).itemsize


def state_bytes(built) -> StateBytes:
    """Per-device bytes of a built run's parameters, optimizer state and gradients, from
    abstract or real arrays' shardings. Gradients take the trainable parameters' layouts and
    dtypes: all of them, or only the adapters when LoRA freezes the base."""

    def flat(state):
        return [
            ("/".join(str(p) for p in path), _shard_bytes(v.get_value()))
            for path, v in nnx.to_flat_state(state)
        ]

    params = flat(nnx.state(built.model, nnx.Param))
    kind = finetune.trainable(built.model)
    trainable = params if kind is nnx.Param else flat(nnx.state(built.model, kind))
    if kind is not nnx.Param:
        params += trainable  # the adapters are parameters too, kept beside the frozen base
    optimizer = sum(_shard_bytes(x) for x in jax.tree.leaves(nnx.state(built.optimizer.opt_state)))
    return StateBytes(
        params=sum(b for _, b in params),
        optimizer=optimizer,
        gradients=sum(b for _, b in trainable),
        largest_params=tuple(sorted(params, key=lambda p: -p[1])[:3]),
    )


def make_mesh(target: Target, candidate: Candidate):

    return get_strategy(candidate.strategy).make_mesh(
        shape=candidate.mesh_shape, devices=list(target.devices)
    )


def run_for(run, candidate: Candidate):
    """The run config with the candidate's choices in it (what train_main would run)."""
    training = dataclasses.replace(
        run.training,
        sharding_strategy=candidate.strategy,
        mesh_shape=",".join(str(n) for n in candidate.mesh_shape),
    )
    model = dataclasses.replace(run.model, remat=candidate.remat)
    if candidate.pipeline_microbatches:
        model = dataclasses.replace(model, pipeline_microbatches=candidate.pipeline_microbatches)
    if candidate.pipeline_schedule:
        model = dataclasses.replace(model, pipeline_schedule=candidate.pipeline_schedule)
    if candidate.context_parallel:
        model = dataclasses.replace(model, context_parallel=candidate.context_parallel)
    optimizer = dataclasses.replace(run.optimizer, micro_batches=candidate.micro_batches)
    return dataclasses.replace(run, training=training, model=model, optimizer=optimizer)


def layout_state_bytes(run, candidate: Candidate, target: Target) -> StateBytes:
    """State bytes per device without compiling (for pruning candidates that cannot fit)."""

    built = build(run_for(run, candidate), make_mesh(target, candidate), abstract=True)
    return state_bytes(built)


# The TPU compiler refuses a step whose temporaries exceed the chip's HBM (libtpu's
# CompileTimeHbmOom): "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required
# for HLO temporaries (39.77G) exceeds available HBM (31.25G)." (G: GiB, XLA's byte printer).
_HBM_OOM = re.compile(r"RESOURCE_EXHAUSTED.*?temporaries \(([\d.]+)([KMGT]?)\)", re.S)
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def compile_time_oom_bytes(message: str) -> int | None:
    """The temporaries' bytes of a compile-time out-of-memory error; None for other errors."""
    match = _HBM_OOM.search(message)
    if match is None:
        return None
    return int(float(match.group(1)) * _UNITS[match.group(2)])


class Compiled(NamedTuple):
    """A step compiled for a target, or refused by the compiler for memory."""

    program: object | None  # the compiled step; None when the compiler ran out of memory
    seconds: float
    oom_temp_bytes: int | None = None  # the temporaries the refused compile asked for
    oom_line: str | None = None  # the compiler's line saying so, at most 300 characters


def compile_or_oom(built) -> Compiled:
    """Compile `built`'s step (launch.build, abstract); a compile-time out-of-memory is a
    result, not an error (`compile_time_oom_bytes`), any other compile error is raised."""
    start = time.perf_counter()
    try:
        compiled, seconds = built.compile()
    except jax.errors.JaxRuntimeError as e:
        temp = compile_time_oom_bytes(str(e))
        if temp is None:
            raise
        line = next((x for x in str(e).splitlines() if "RESOURCE_EXHAUSTED" in x), str(e))
        return Compiled(None, time.perf_counter() - start, temp, line.strip()[:300])
    return Compiled(compiled, seconds)


def has_reference(run) -> bool:
    """Whether the run's objective runs a frozen reference's forward each step (DPO; with
    LoRA the base without adapters), which the step-time model counts beside the config's
    training FLOPs."""
    objective = preference.Objective.from_training(run.training)
    return objective is not None and objective.needs_reference


def _estimate(run, candidate, target, mesh, pp, exposed, overlapped):
    return estimate_step(
        run.model.decoder_config(),
        seq_len=run.data.seq_len,
        global_batch=run.data.global_batch_size,
        num_devices=mesh.size,
        remat=candidate.remat,
        chip=target.chip,
        exposed_comm=exposed,
        overlapped_comm=overlapped,
        pipeline=pp,
        reference=has_reference(run),
    )


def _refused(run, candidate, target, mesh, state, pp, refused: Compiled) -> dict:
    """What a plan says of a step the compiler refused for memory: it does not fit, its
    memory the state's arguments (parameters + optimizer state, from the layouts) plus the
    temporaries the compiler asked for, with no program to read collectives, kernels or a
    forecast from (so its bound is compute alone)."""
    arguments, temp = state.params + state.optimizer, refused.oom_temp_bytes
    return dict(
        memory=StepMemory(arguments, 0, 0, temp, arguments + temp, 0),
        estimate=_estimate(run, candidate, target, mesh, pp, exposed=0.0, overlapped=0.0),
        compile_error=refused.oom_line,
    )


def _read(run, candidate, target, mesh, pp, compiled) -> dict:
    """What a plan reads from the compiled step: its memory, host arrays, collectives (and
    the step-time bound with their time), kernels, traffic and dot dtypes."""
    text = compiled.as_text()
    ops = hlo.collectives(text, dict(mesh.shape))

    devices_grid = np.asarray(mesh.devices)
    dims = target.physical_dims

    def bandwidth(axis_index):
        return axis_bandwidth(devices_grid, axis_index, target.chip, dims)

    exposed, overlapped = comm_seconds(ops, bandwidth, tuple(mesh.axis_names))
    return dict(
        memory=step_memory(compiled),
        estimate=_estimate(run, candidate, target, mesh, pp, exposed, overlapped),
        host_arrays=hlo.host_arrays(text),
        collectives=ops,
        kernels=dict(sorted(hlo.kernels(text).items())),
        traffic=traffic(text),
        dot_dtypes=dict(sorted(hlo.dot_dtypes(text).items())),
    )


def compile_plan(run, candidate: Candidate, target: Target) -> Plan:
    """Compile the train step for `candidate` on `target`; raises UsageError for a candidate
    the layouts or the batch cannot take (a split that does not divide). A step the compiler
    refuses for memory is a plan that does not fit. The step forecast is added by
    `planning.forecast.add_forecast` (two more compiles, so only where asked)."""
    run = run_for(run, candidate)
    mesh = make_mesh(target, candidate)
    built = build(run, mesh, abstract=True)
    state = state_bytes(built)
    pp = built.plan.pipeline
    outcome = compile_or_oom(built)
    if outcome.program is None:
        measured = _refused(run, candidate, target, mesh, state, pp, outcome)
    else:
        measured = _read(run, candidate, target, mesh, pp, outcome.program)
    plan = Plan(
        candidate=candidate,
        target=target,
        mesh=dict(mesh.shape),
        global_batch=run.data.global_batch_size,
        seq_len=run.data.seq_len,
        state=state,
        schedule=pp,
        compile_seconds=outcome.seconds,
        **measured,
    )
    if outcome.program is not None:
        from nnx_zoo.planning.moe import exchange_summary

        plan.moe = exchange_summary(plan, run.model.decoder_config())
    return plan
