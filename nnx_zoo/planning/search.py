"""`--sharding_strategy=auto`: among strategies x mesh shapes x remat policies x micro-batch
counts, the candidate that fits and has the best predicted step time (`Plan.predicted`: the
forecast where the target has one, else the bound).

Every candidate cannot be compiled (a TPU compile of an 8B step takes minutes), so the search
is branch and bound on the step-time model:
- a candidate whose parameters + optimizer state + gradients (from the layouts, no compile)
  exceed the chip's memory cannot fit and is never compiled;
- compute alone (FLOPs at peak, remat included) is a lower bound of a candidate's predicted
  step time (the bound and the forecast are never below it); candidates are compiled in order
  of that bound, and the search stops once the bound reaches the best predicted time found;
- more remat (none < dots < full) or more micro-batches never predict a faster step for the
  same layout and mesh (more FLOPs; as much or more communication), so once a candidate fits,
  those variants of it are not compiled;
- and the other way round for memory: once a candidate does not fit, its variants with less
  remat and no more micro-batches cannot fit either, and one with k' > k micro-batches needs
  at least the arguments plus k/k' of the rest (its activations shrink at most as 1/k, the
  rest stays), so it is not compiled where even that exceeds the chip.
Only candidates that fit get a forecast (its two extra compiles), unless all are compiled.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax

from nnx_zoo.errors import UsageError
from nnx_zoo.planning.compile import (
    Candidate,
    Plan,
    Target,
    compile_plan,
    has_reference,
    layout_state_bytes,
    run_for,
)
from nnx_zoo.planning.estimate import compute_lower_bound
from nnx_zoo.planning.forecast import add_forecast
from shardings import get_strategy
from shardings.hybrid import num_granules
from shardings.specs import entry_size
from shardings.strategies import CONTEXT, DATA, MAX_MODEL_AXIS, MODEL
from zoo.layers import pipeline
from zoo.layers.config import CONTEXT_PARALLEL

REMAT_ORDER = ("none", "dots", "full")
GiB = 1024**3


def _gib(n: float) -> str:
    """GiB with the digits that tell a small model's figures apart (0.00143, not 0.0)."""
    return f"{n / GiB:.1f}" if n >= GiB else f"{n / GiB:.3g}"


class NoFitError(UsageError):
    """No candidate fits; str() is one line naming the smallest change that would."""


@dataclasses.dataclass
class SearchResult:
    best: Plan | None
    plans: list[Plan]  # every candidate compiled, in compile order
    skipped: list[tuple[Candidate, str]]  # not compiled, and why
    reason: str  # one line: why `best`, or what would fit


def candidate_space(
    run,
    target: Target,
    strategies,
    remats=REMAT_ORDER,
    micro_batches=(1, 2, 4, 8),
    mesh_shapes: dict[str, tuple[int, ...]] | None = None,
    choose_pipeline: bool = False,
    choose_context_parallel: bool = False,
) -> list[Candidate]:
    """Every combination that the layouts and the batch allow on `target`'s device count.

    Two-axis strategies get every `model` size that divides the device count and the kv-head
    count, up to the strategies' tensor-parallel cap; `mesh_shapes` fixes a strategy's shape.
    `choose_pipeline` (auto): a pipeline strategy's micro-batch count, when the config leaves
    it 0, is `pipeline_microbatches`' (else the config's, as train_main would run it).
    `choose_context_parallel` (auto): a strategy that splits T over `context` is tried with
    both of `CONTEXT_PARALLEL` (ring: K/V memory / context, the same compute; which is faster
    is the collectives' to say), else with the config's.
    """

    n = len(target.devices)
    cfg = run.model.decoder_config()
    batch = run.data.global_batch_size
    slices = num_granules(list(target.devices))
    out = []
    for name in strategies:
        strategy = get_strategy(name)
        if mesh_shapes and name in mesh_shapes:
            shapes = [tuple(mesh_shapes[name])]
        else:
            shapes = _mesh_shapes(strategy, n, cfg, slices)
        batch_axes = strategy.batch_spec()[0]
        stage_axis = strategy.lm_sharding().stage_axis
        methods = ("",)
        if CONTEXT in strategy.axes:
            methods = CONTEXT_PARALLEL if choose_context_parallel else (cfg.context_parallel,)
        for shape in shapes:
            sizes = dict(zip(strategy.axes, shape, strict=True))
            data = entry_size(batch_axes, sizes)
            for remat in remats:
                for k in micro_batches:
                    if batch % k or (batch // k) % data:
                        continue
                    pm = 0
                    if stage_axis is not None and choose_pipeline and not cfg.pipeline_microbatches:
                        # Rows per data shard (the batch split but `stage`) of one forward.
                        rows = batch // k // (data // sizes[stage_axis])
                        pm = pipeline_microbatches(sizes[stage_axis], rows)
                        if not pm:
                            continue
                    for schedule in _schedules(cfg, stage_axis, choose_pipeline):
                        out += [
                            Candidate(name, tuple(shape), remat, k, pm, schedule, m)
                            for m in methods
                        ]
    return out


def _schedules(cfg, stage_axis, choose_pipeline: bool) -> tuple[str, ...]:
    """The pipeline schedules to try ("": the config's, as train_main would run it). `auto`
    tries GPipe and 1F1B where the config leaves the schedule to pipeline_repeats and that is
    1: the same bubble, 1F1B keeping 2S-1 micro-batches' activations instead of Mb+S-1 at the
    cost of the LM head's work on one stage for every row (`PipelinePlan.head_factor`)."""
    auto_gpipe = cfg.pipeline_schedule == "auto" and cfg.pipeline_repeats == 1
    if stage_axis is None or not choose_pipeline or not auto_gpipe:
        return ("",)
    return ("gpipe", "1f1b")


def pipeline_microbatches(stages: int, rows: int) -> int:
    """`auto`'s micro-batch count for a pipeline of `stages` stages whose forward pass holds
    `rows` rows per data shard: the largest multiple of `stages` up to 4 x `stages` that
    divides `rows` (a micro-batch keeps at least one row per data shard), 0 if none.

    At 4 x stages the GPipe bubble, (S-1)/(Mb + S-1), is 1/9 of a 2-stage step and under 1/5
    for any S; more micro-batches shrink it further but gather each stage's FSDP weights once
    more per micro-batch and run smaller matmuls, which the step-time bound does not price
    well enough to go past it."""
    for mb in range(4 * stages, stages - 1, -stages):
        if rows % mb == 0:
            return mb
    return 0


def _mesh_shapes(strategy, n: int, cfg, slices: int) -> list[tuple[int, ...]]:
    """The strategy's default shape for this model, and for tensor-parallel ones every other
    `model` size that divides the devices and the kv heads, up to the strategies' cap."""

    default = tuple(strategy.default_mesh_shape(n, cfg, num_slices=slices))
    shapes = [default]
    if MODEL in strategy.axes and CONTEXT not in strategy.axes:
        sizes = dict(zip(strategy.axes, default, strict=True))
        inner = sizes[DATA] * sizes[MODEL]
        for m in range(2, min(inner, MAX_MODEL_AXIS) + 1):
            if inner % m == 0 and cfg.num_kv_heads % m == 0:
                shape = tuple({**sizes, MODEL: m, DATA: inner // m}[a] for a in strategy.axes)
                if shape not in shapes:
                    shapes.append(shape)
    return shapes


def distinct_strategies(names, cfg, target: Target) -> list[str]:
    """The strategies worth searching on `target`: those whose default mesh gives every axis
    but `data` more than one device (else it is a simpler strategy again: hsdp on one slice
    is fsdp, an expert axis of 1 on a dense model is fsdp)."""

    n, slices = len(target.devices), num_granules(list(target.devices))
    out = []
    for name in names:
        strategy = get_strategy(name)
        shape = strategy.default_mesh_shape(n, cfg, num_slices=slices)
        sizes = dict(zip(strategy.axes, shape, strict=True))
        if all(size > 1 for axis, size in sizes.items() if axis != DATA):
            out.append(name)
    return out


_CACHE: dict[tuple, Plan] = {}


def cached_compile(run, candidate: Candidate, target: Target) -> Plan:
    """`compile_plan`, once per (run, candidate, target devices) in this process: the compile
    does not depend on the chip's memory, so a smaller synthetic chip reuses it."""

    # The run as the candidate sets it: requests that differ only in what it overrides
    # (`auto` vs a strategy name, the config's remat) share a compile.
    key = (run_for(run, candidate), candidate, target.name, len(target.devices))
    if key not in _CACHE:
        _CACHE[key] = compile_plan(run, candidate, target)
    return dataclasses.replace(_CACHE[key], target=target)


def search(
    run,
    target: Target,
    candidates: list[Candidate],
    *,
    max_compiles: int = 16,
    exhaustive: bool = False,
    log: Callable[[str], None] = lambda _: None,
) -> SearchResult:
    """The best candidate that fits, by predicted step time (see the module docstring). Each
    compiled plan gets its forecast (`planning.forecast.add_forecast`: two small compiles).

    `exhaustive` compiles every candidate whose state can fit (the bound, the dominance rule
    and the compile budget are off): what plan_main does for named strategies."""
    cfg = run.model.decoder_config()
    memory = target.chip.memory_bytes
    bounds = {
        c: compute_lower_bound(
            cfg,
            seq_len=run.data.seq_len,
            global_batch=run.data.global_batch_size,
            num_devices=len(target.devices),
            remat=c.remat,
            chip=target.chip,
            pipeline=_schedule(run_for(run, c).model.decoder_config(), c),
            reference=has_reference(run),
        )
        for c in candidates
    }
    strategy_rank = {c.strategy: i for i, c in enumerate(dict.fromkeys(candidates))}
    order = sorted(
        candidates,
        key=lambda c: (bounds[c], c.micro_batches, strategy_rank[c.strategy], c.mesh_shape),
    )
    plans: list[Plan] = []
    skipped: list[tuple[Candidate, str]] = []
    best: Plan | None = None
    state_cache: dict[tuple, int] = {}
    fitted: list[Candidate] = []
    failed: list[Plan] = []
    for c in candidates if exhaustive else order:
        if exhaustive:
            pass
        elif best is not None and bounds[c] >= best.predicted.step_seconds:
            skipped.append((c, "its compute alone is slower than the best found"))
            continue
        elif any(_dominated(c, f) for f in fitted):
            skipped.append((c, "a variant with less remat / fewer micro-batches fits"))
            continue
        elif (why := _cannot_fit(c, failed, memory)) is not None:
            skipped.append((c, why))
            continue
        layout = (c.strategy, c.mesh_shape)
        try:
            if layout not in state_cache:
                s = layout_state_bytes(run, c, target)
                state_cache[layout] = s.params + s.optimizer + s.gradients
        except ValueError as e:
            skipped.append((c, str(e)))
            continue
        if state_cache[layout] > memory:
            skipped.append((c, f"state alone needs {state_cache[layout] / GiB:.1f} GiB"))
            continue
        if len(plans) >= max_compiles and not exhaustive:
            skipped.append((c, f"over the compile budget ({max_compiles})"))
            continue
        log(f"compiling {c.describe()} for {target.name} ...")
        try:
            plan = cached_compile(run, c, target)
        except ValueError as e:
            skipped.append((c, str(e)))
            continue
        if plan.fits or exhaustive:
            add_forecast(run, plan)
        plans.append(plan)
        log(
            f"  {plan.required_bytes / GiB:.2f} GiB of {memory / GiB:.1f}, "
            f"{'fits' if plan.fits else 'does not fit'}, {_step_text(plan)} "
            f"({plan.compile_seconds:.0f} s compile)"
        )
        if not plan.fits:
            failed.append(plan)
        else:
            fitted.append(c)
            if best is None or plan.predicted.step_seconds < best.predicted.step_seconds:
                best = plan
    if best is None:

        def verify(r, c: Candidate) -> Plan:
            log(f"compiling {c.describe()} (batch {r.data.global_batch_size}) to check advice ...")
            return cached_compile(r, c, target)

        reason = smallest_change(run, target, plans, state_cache, compile=verify)
        return SearchResult(None, plans, skipped, reason)
    return SearchResult(best, plans, skipped, _why(best, plans, skipped))


def _schedule(cfg, c: Candidate):
    """The pipeline schedule of a candidate (its bubble is compute no candidate escapes), or
    None; None too for sizes the pipeline cannot run (the compile will say why). Before
    anything is built, so from `pipeline.plan_for` on the candidate's mesh shape: the
    function `zoo.plan.plan_model` derives `ModelPlan.pipeline` with, which the compiled
    step then runs."""
    strategy = get_strategy(c.strategy)
    mesh = jax.sharding.AbstractMesh(tuple(c.mesh_shape), tuple(strategy.axes))
    try:
        return pipeline.plan_for(cfg, strategy.lm_sharding(), mesh)
    except ValueError:
        return None


def _at_least_as_much_remat(a: str, b: str) -> bool:
    # Policies outside REMAT_ORDER (offload, save_*_proj) are only ordered against themselves.
    if a in REMAT_ORDER and b in REMAT_ORDER:
        return REMAT_ORDER.index(a) >= REMAT_ORDER.index(b)
    return a == b


def _dominated(c: Candidate, fitted: Candidate) -> bool:
    # A schedule is part of the layout (1F1B's memory and time differ from GPipe's), and so is
    # how attention sees the keys (all_gather and ring: neither dominates).
    layout = (c.strategy, c.mesh_shape, c.pipeline_schedule, c.context_parallel)
    fitted_layout = (
        fitted.strategy,
        fitted.mesh_shape,
        fitted.pipeline_schedule,
        fitted.context_parallel,
    )
    return (
        layout == fitted_layout
        and _at_least_as_much_remat(c.remat, fitted.remat)
        and c.micro_batches >= fitted.micro_batches
        and c != fitted
    )


def _cannot_fit(c: Candidate, failed: list[Plan], memory: int) -> str | None:
    """Why `c` cannot fit, from a compiled variant of the same layout that did not; None if
    no such variant says so."""
    for plan in failed:
        f = plan.candidate
        same_layout = (
            c.strategy,
            c.mesh_shape,
            c.pipeline_microbatches,
            c.pipeline_schedule,
            c.context_parallel,
        ) == (
            f.strategy,
            f.mesh_shape,
            f.pipeline_microbatches,
            f.pipeline_schedule,
            f.context_parallel,
        )
        if not same_layout or c == f or not _at_least_as_much_remat(f.remat, c.remat):
            continue
        if c.micro_batches <= f.micro_batches:
            return f"{f.describe()} does not fit, and this has no more remat or micro-batches"
        if c.remat != f.remat:
            continue
        arguments = plan.state.params + plan.state.optimizer
        least = arguments + (plan.required_bytes - arguments) * f.micro_batches / c.micro_batches
        least += accumulator_bytes(plan.state, f.micro_batches, c.micro_batches)
        if least > memory:
            return (
                f"needs at least {least / GiB:.1f} GiB ({f.describe()} needs "
                f"{plan.required_bytes / GiB:.1f}; activations shrink at most as 1/k, and "
                "more than one micro-batch adds a gradient accumulator)"
            )
    return None


def _step_text(plan: Plan) -> str:
    """'forecast 0.32 s/step (bound 0.13)', or 'bound 0.13 s/step (no forecast)'."""
    bound = plan.estimate.step_seconds
    if plan.forecast is None:
        return f"bound {bound:.4g} s/step ({'no forecast' if plan.fits else 'not forecast'})"
    return f"forecast {plan.forecast.step_seconds:.4g} s/step (bound {bound:.4g})"


def _why(best: Plan, plans: list[Plan], skipped) -> str:
    e = best.estimate
    fit = [p for p in plans if p.fits and p is not best]
    runner = min(fit, key=lambda p: p.predicted.step_seconds) if fit else None
    # Communication-bound once collectives add to the compute time at all.
    bound = "compute" if e.step_seconds <= e.compute_seconds * (1 + 1e-9) else "communication"
    parts = [
        f"auto picked {best.candidate.describe()}: {_step_text(best)}, "
        f"MFU {best.predicted.mfu:.1%}, {best.required_bytes / GiB:.1f} of "
        f"{best.target.chip.memory_bytes / GiB:.1f} GiB ({bound}-bound)"
    ]
    if runner is not None:
        parts.append(
            f"next best {runner.candidate.describe()} at "
            f"{runner.predicted.step_seconds:.4g} s ({runner.predicted_from})"
        )
    schedule = _schedule_why(best, plans, skipped)
    if schedule:
        parts.append(schedule)
    no_fit = sum(not p.fits for p in plans)
    parts.append(f"{len(plans)} compiled, {no_fit} did not fit, {len(skipped)} ruled out")
    return "; ".join(parts)


def _schedule_why(best: Plan, plans: list[Plan], skipped) -> str:
    """Why the pick's pipeline schedule over the other one `auto` tried for the same layout
    (GPipe or 1F1B: `_schedules`); "" when it tried none."""
    c = best.candidate
    if not c.pipeline_schedule:
        return ""

    def twin(other: Candidate) -> bool:
        return other != c and dataclasses.replace(other, pipeline_schedule=c.pipeline_schedule) == c

    mine = f"pipeline_schedule={c.pipeline_schedule}"
    for p in plans:
        if not twin(p.candidate):
            continue
        other = p.candidate.pipeline_schedule
        if not p.fits:
            return (
                f"{mine}: {other} needs {p.required_bytes / GiB:.1f} GiB (its in-flight "
                f"micro-batches {p.schedule.in_flight if p.schedule else '?'} against "
                f"{best.schedule.in_flight if best.schedule else '?'}), over the chip's "
                f"{best.target.chip.memory_bytes / GiB:.1f}"
            )
        return (
            f"{mine}: {other} fits in {p.required_bytes / GiB:.1f} GiB but predicts "
            f"{p.predicted.step_seconds:.4g} s"
        )
    for other, why in skipped:
        if twin(other):
            return f"{mine}: {other.pipeline_schedule} not compiled ({why})"
    return mine


def accumulator_bytes(state, k_from: int, k_to: int) -> int:
    """Bytes a step with `k_to` micro-batches holds beyond one with `k_from`: the gradient
    accumulator (`training.optim.accumulate_gradients`: the gradients' shapes and dtypes,
    float32 for float32 parameters), live through every micro-batch, which a step of one
    micro-batch does not have. Its activations shrink at most as 1/k; this never does."""
    return state.gradients if k_from == 1 < k_to else 0


def _with_batch(run, batch: int):
    return dataclasses.replace(run, data=dataclasses.replace(run.data, global_batch_size=batch))


def smallest_change(
    run,
    target: Target,
    plans: list[Plan],
    state_cache: dict,
    compile: Callable[[object, Candidate], Plan] | None = None,
) -> str:
    """One line: the least disruptive change that should fit (more remat, then more
    micro-batches, then a smaller batch, then more chips).

    More micro-batches add a float32 gradient accumulator (`accumulator_bytes`) and shrink
    only what scales with the rows, which a compiled step does not tell apart from what does
    not (gathered weights, the MoE exchange's buffers); so with `compile` (the search's own
    compile, cached) a micro-batch count or a smaller batch is compiled before it is advised,
    and advised only where it fits. A change that would not lower the peak is never advised;
    without `compile` the advice is the model's alone."""
    memory = target.chip.memory_bytes
    n = len(target.devices)
    batch = run.data.global_batch_size
    head = f"nothing fits in {_gib(memory)} GiB per chip on {target.name}"
    if not plans:
        least = min(state_cache.values()) if state_cache else None
        if least is None:
            return f"{head}: no candidate could be laid out on {n} devices"
        # Float32 parameters, two Adam moments and gradients, split over every chip (fsdp).
        split = run.model.decoder_config().num_params() * 16 / n
        if split <= 0.8 * memory < least:
            return (
                f"{head}: parameters + optimizer state + gradients alone need "
                f"{_gib(least)} GiB per chip; split over all {n} chips they need "
                f"{_gib(split)}: use --sharding_strategy=fsdp"
            )
        chips = _next_power_of_two(math.ceil(split * n / (0.8 * memory)))
        return (
            f"{head}: parameters + optimizer state + gradients alone need "
            f"{_gib(least)} GiB per chip; use more chips (at least {chips}, with fsdp)"
        )
    lowest = min(plans, key=lambda p: p.required_bytes)
    most_remat = [p for p in plans if p.candidate.remat in ("full", "offload")]
    if most_remat and lowest not in most_remat:
        # Full remat was compiled and did not fit either: advise from there, not "use it".
        lowest = min(most_remat, key=lambda p: p.required_bytes)
    c = lowest.candidate
    least = f"{head} (least: {_gib(lowest.required_bytes)} GiB with {c.describe()})"
    if c.remat not in ("full", "offload"):
        return f"{least}; use more remat: --remat=full"
    state = lowest.state.params + lowest.state.optimizer + lowest.state.gradients
    activations = lowest.required_bytes - state
    tried = []  # what was compiled and would not fit, said beside the advice given instead
    if state < memory and activations > 0:
        # Rows split over the batch axes (fsdp_ep's: data and expert), in every micro-batch.
        strategy = get_strategy(c.strategy)
        sizes = {axis: lowest.mesh.get(axis, 1) for axis in strategy.axes}
        data = entry_size(strategy.batch_spec()[0], sizes)
        k_needed = _micro_batches_needed(lowest, memory, batch, data)
        if k_needed:
            advice = f"use more micro-batches: --micro_batches={k_needed}"
            if compile is None:
                return f"{least}; {advice}"
            checked = _checked(compile, run, dataclasses.replace(c, micro_batches=k_needed))
            if checked is not None and checked.fits:
                fits = f"--micro_batches={k_needed} compiled: {_gib(checked.required_bytes)} GiB"
                return f"{least}; {fits}; {advice}"
            if checked is not None:
                extra = accumulator_bytes(lowest.state, c.micro_batches, k_needed)
                tried.append(
                    f"--micro_batches={k_needed} would need {_gib(checked.required_bytes)} GiB"
                    + (f" (its float32 gradient accumulator: {_gib(extra)})" if extra else "")
                )
        fraction = (memory - state) / activations
        step = data * c.micro_batches
        smaller = int(batch * fraction) // step * step
        if step <= smaller < batch:
            advice = f"use a smaller batch: --batch_size={smaller} or less"
            if compile is None:
                return f"{least}; {advice}"
            checked = _checked(compile, _with_batch(run, smaller), c)
            if checked is not None and checked.fits:
                fits = f"--batch_size={smaller} compiled: {_gib(checked.required_bytes)} GiB"
                return f"{least}; {tried_text(tried)}{fits}; {advice}"
            if checked is not None:
                needs = _gib(checked.required_bytes)
                tried.append(f"--batch_size={smaller} would need {needs} GiB")
    chips = _next_power_of_two(math.ceil(n * lowest.required_bytes / (0.8 * memory)))
    return f"{least}; {tried_text(tried)}use more chips (about {chips})"


def tried_text(tried: list[str]) -> str:
    return "".join(f"{t}; " for t in tried)


def _checked(compile, run, candidate: Candidate) -> Plan | None:
    """The compiled plan of a change about to be advised; None where it cannot be laid out."""
    try:
        return compile(run, candidate)
    except ValueError:
        return None


def _micro_batches_needed(lowest: Plan, memory: int, batch: int, data: int) -> int:
    """The fewest micro-batches (a power of two, above the plan's) that the memory model says
    fit, 0 where none that the batch splits into does. The model: the arguments, the
    gradient accumulator (`accumulator_bytes`), one micro-batch's gradients (and the plan's
    own accumulator) kept whole, the rest of the plan's step shrunk as 1/k. Optimistic (the
    rest need not shrink), so the search compiles the count before advising it."""
    c = lowest.candidate
    arguments = lowest.state.params + lowest.state.optimizer
    rest = lowest.required_bytes - arguments
    grads = lowest.state.gradients
    fixed = min(rest, grads * (2 if c.micro_batches > 1 else 1))
    k = _next_power_of_two(c.micro_batches + 1)
    while k <= batch and batch % k == 0 and (batch // k) % data == 0:
        need = arguments + accumulator_bytes(lowest.state, c.micro_batches, k) + fixed
        if need + (rest - fixed) * c.micro_batches / k <= memory:
            return k
        k *= 2
    return 0


def _next_power_of_two(x: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(x, 1))))
