"""What plan_main.py and `train_main.py --sharding_strategy=auto` run: a request in, plans out.

Every mistake in a request raises UsageError with one line (plan_main exits 2 with it).
"""

from __future__ import annotations

import dataclasses
import json

from nnx_zoo.errors import UsageError
from nnx_zoo.launch.build import plan_run, run_devices, starting_from
from nnx_zoo.planning.chips import chip_for, chip_name_for
from nnx_zoo.planning.compile import Candidate, Target, make_mesh, make_target, run_for
from nnx_zoo.planning.moe import load_from_run, load_summary
from nnx_zoo.planning.report import table
from nnx_zoo.planning.search import (
    REMAT_ORDER,
    NoFitError,
    candidate_space,
    distinct_strategies,
    search,
)
from nnx_zoo.training.config import RunConfig
from shardings import STRATEGIES, get_strategy
from shardings.hybrid import num_granules
from zoo.layers import remat as remat_policies


@dataclasses.dataclass(frozen=True)
class Request:
    """A plan request: the run train_main would start, and what to search around it.

    `config` is the run config as a dict: train_main's (its config file with the command
    line's `--config.*` overrides applied), or, with `model`, a preset with planning defaults
    (bf16, full remat, one row per device, 2048 tokens, the target's flash attention) and
    those overrides on top. `explicit` names the `--config.*` fields the command line set, so
    a short alias (`batch_size`, ...) that disagrees with one is refused.
    """

    topology: str
    config: dict | None = None
    model: str | None = None
    explicit: dict = dataclasses.field(default_factory=dict)
    strategies: str | None = None  # None: the config's (the run train_main would start)
    mesh_shape: str | None = None
    batch_size: int | None = None
    seq_len: int | None = None
    remat: list[str] | None = None
    micro_batches: list[str] | None = None
    attention_impl: str | None = None
    dtype: str | None = None
    memory_gib: float | None = None
    max_compiles: int = 16
    moe_load_from: str | None = None  # a run's workdir: its router load (planning.moe)
    # train_main's --init_from: the model is this Hugging Face checkpoint's architecture.
    init_from: str | None = None


# Short flag -> the config field it stands for.
ALIASES = {
    "batch_size": "data.global_batch_size",
    "seq_len": "data.seq_len",
    "dtype": "model.dtype",
    "attention_impl": "model.attention_impl",
}


def _preset_config(model: str, num_devices: int) -> dict:
    return {
        "name": model,
        "model": {
            "preset": model,
            "dtype": "bfloat16",
            "remat": "full",
            "attention_impl": "auto",
        },
        "data": {"seq_len": 2048, "global_batch_size": num_devices},
    }


def _set(raw: dict, path: str, value) -> None:
    section, field = path.split(".")
    raw[section] = {**(raw.get(section) or {}), field: value}


def load_run(request: Request, num_devices: int):
    """(typed run config, its raw dict): the request's config with its overrides and short
    aliases folded in. The candidates set micro-batches, so the config's cannot veto one."""

    if request.model:
        if request.config is not None:
            raise UsageError("give --config or --model, not both")
        raw = _preset_config(request.model, num_devices)
        for path, value in request.explicit.items():
            _set(raw, path, value)
    elif request.config is not None:
        raw = {k: dict(v) if isinstance(v, dict) else v for k, v in request.config.items()}
    else:
        raise UsageError("give --config=configs/<name>.py or --model=<preset>")
    for alias, path in ALIASES.items():
        value = getattr(request, alias)
        if value is None:
            continue
        if path in request.explicit and request.explicit[path] != value:
            raise UsageError(
                f"--{alias}={value} disagrees with --config.{path}={request.explicit[path]}; "
                "give one of them"
            )
        _set(raw, path, value)
    config_k = int((raw.get("optimizer") or {}).get("micro_batches", 1))
    _set(raw, "optimizer.micro_batches", 1)
    if request.model and request.init_from:
        raise UsageError(
            "--init_from sets the model, and so does --model: give one of them (with "
            "--init_from, give train_main's --config)"
        )
    run = starting_from(RunConfig.from_config_dict(raw), request.init_from)
    run.model.decoder_config()  # an unknown preset fails here, with the valid ones
    return run, config_k


def _strategies(text: str, auto_ok: bool = True) -> tuple[list[str], bool]:

    names = [s.strip() for s in text.split(",") if s.strip()]
    if names == ["auto"] and auto_ok:
        # Pipeline strategies included: the search chooses their micro-batch count
        # (planning.search.pipeline_microbatches) when the config leaves it 0.
        return list(STRATEGIES), True
    if names == ["all"]:
        return list(STRATEGIES), False
    for name in names:
        get_strategy(name)  # one line naming the valid ones
    if not names:
        raise UsageError(f"--sharding_strategy is empty; valid: {', '.join(STRATEGIES)}, all, auto")
    return names, False


def _ints(values, what: str) -> tuple[int, ...]:
    try:
        out = tuple(int(v) for v in values)
    except ValueError:
        raise UsageError(f"--{what}={','.join(values)}: expected integers like 1,2,4") from None
    if any(v < 1 for v in out):
        raise UsageError(f"--{what}={','.join(values)}: every value must be >= 1")
    return out


def build(request: Request):
    """(run config, target, candidates, auto?) for a request."""

    target = make_target(request.topology, request.memory_gib)
    n = len(target.devices)
    run, config_k = load_run(request, n)
    strategies = request.strategies or ("all" if request.model else run.training.sharding_strategy)
    names, auto = _strategies(strategies)
    if auto:
        names = distinct_strategies(names, run.model.decoder_config(), target)
    config_remat = run.model.remat
    named = request.explicit.get("model.remat")
    if request.remat and named is not None and list(request.remat) != [named]:
        raise UsageError(
            f"--remat={','.join(request.remat)} disagrees with --config.model.remat={named}; "
            "give one of them"
        )
    remats = tuple(request.remat) if request.remat else (REMAT_ORDER if auto else (config_remat,))
    # `auto` searches REMAT_ORDER; a policy named by flag or config may be any the trainer
    # runs, offload included (TPU/GPU targets only).
    for r in remats:
        if r not in remat_policies.POLICIES:
            raise UsageError(f"--remat={r}: valid: {', '.join(remat_policies.POLICIES)}")
        remat_policies.check_platform(r, target.chip.platform)
    micro = (
        _ints(request.micro_batches, "micro_batches")
        if request.micro_batches
        else ((1, 2, 4, 8) if auto else (config_k,))
    )
    mesh_shapes = None
    mesh_shape = request.mesh_shape or (run.training.mesh_shape if len(names) == 1 else None)
    if mesh_shape:
        if len(names) != 1:
            raise UsageError("--mesh_shape needs exactly one --sharding_strategy")
        strategy = get_strategy(names[0])
        mesh = strategy.make_mesh(shape=mesh_shape, devices=list(target.devices))
        mesh_shapes = {names[0]: tuple(mesh.shape.values())}
    elif not auto:
        # Each strategy's documented default mesh, as train_main would build it.
        cfg = run.model.decoder_config()
        slices = num_granules(list(target.devices))
        mesh_shapes = {s: get_strategy(s).default_mesh_shape(n, cfg, slices) for s in names}
    if not auto and len(names) == 1:
        # The plan of one run, as train_main would start it: train_main's own checks name
        # what is wrong with it (the stages, the batch over its axes, ...), once, before any
        # candidate is filtered or compiled.
        _check_as_train_main(run, target, names[0], mesh_shapes[names[0]], remats, micro)
    candidates = candidate_space(
        run,
        target,
        names,
        remats,
        micro,
        mesh_shapes,
        choose_pipeline=auto,
        choose_context_parallel=auto,
    )
    if not candidates:
        raise UsageError(
            f"no candidate: batch {run.data.global_batch_size} does not split into "
            f"micro-batches {list(micro)} over the batch axes of any mesh of {n} devices; use "
            f"a batch that is a multiple of {n}"
        )
    return run, target, candidates, auto


def _check_as_train_main(run, target: Target, name: str, shape, remats, micro) -> None:
    """UsageError (train_main's line for the same flags) for the first remat / micro-batch
    count whose run train_main would refuse on `target`'s devices."""
    for remat in remats:
        for k in micro:
            candidate = Candidate(name, tuple(shape), remat, k, 0)
            if run.data.global_batch_size % k:
                raise UsageError(
                    f"batch {run.data.global_batch_size} does not split into {k} micro-batches"
                )
            plan_run(run_for(run, candidate), make_mesh(target, candidate))


def _measured_load(request: Request, run):
    if not request.moe_load_from:
        return None
    cfg = run.model.decoder_config()
    if not cfg.is_moe:
        raise UsageError(
            f"--moe_load_from: {run.model.preset or 'this model'} has no experts; "
            "it applies to MoE models (qwen3-moe-*, mixtral-*)"
        )
    return load_from_run(request.moe_load_from, cfg.num_experts)


def plan(request: Request, as_json: bool = False) -> str:
    """Run the request: the table (or JSON lines), and with `auto` the pick's one-line why.
    Raises UsageError on bad input and NoFitError (a UsageError) when nothing fits."""
    run, target, candidates, auto = build(request)
    measured = _measured_load(request, run)  # before any compile: a bad path fails at once
    log = (lambda _: None) if as_json else (lambda line: print(line, flush=True))
    result = search(
        run,
        target,
        candidates,
        max_compiles=request.max_compiles,
        exhaustive=not auto,
        log=log,
    )
    for p in result.plans if measured is not None else []:
        p.moe = {**p.moe, **load_summary(measured, p)}
    if as_json:
        rows = [p.to_json() | {"auto": auto and p is result.best} for p in result.plans]
        text = "\n".join(json.dumps(r) for r in rows)
    else:
        text = table(result.plans) if result.plans else ""
    for c, why in result.skipped if not (auto or as_json) else []:
        text += f"\nnot compiled: {c.describe()}: {why}"
    if result.best is None:
        print(text, flush=True)
        raise NoFitError(result.reason)
    if auto:
        text += "\n" + (json.dumps({"auto_reason": result.reason}) if as_json else result.reason)
    return text.strip("\n")


def resolve_auto(run, log=print, init_from: str | None = None):
    """`train_main --sharding_strategy=auto`: the run config with the pick's strategy, mesh,
    remat and micro-batches, for this process's view of the run's devices (`run_devices`), and
    the model the run starts from (`init_from`'s architecture where given). Logs the one-line
    why; raises NoFitError (a UsageError) when nothing fits."""

    if run.training.mesh_shape:  # it would be silently replaced by the pick's mesh
        raise UsageError(
            f"mesh shape {run.training.mesh_shape!r} cannot be combined with "
            "--sharding_strategy=auto, which chooses the mesh; name a strategy to set one"
        )
    given, run = run, starting_from(run, init_from)
    devices = run_devices(run)
    chip = chip_for(chip_name_for(devices[0]))
    target = Target(
        name=f"{devices[0].device_kind}:{len(devices)}", devices=tuple(devices), chip=chip
    )
    names, _ = _strategies("auto")
    names = distinct_strategies(names, run.model.decoder_config(), target)
    candidates = candidate_space(
        run,
        target,
        names,
        REMAT_ORDER,
        (1, 2, 4, 8),
        choose_pipeline=True,
        choose_context_parallel=True,
    )
    if not candidates:
        raise UsageError(
            f"--sharding_strategy=auto: batch {run.data.global_batch_size} splits over none of "
            f"the meshes of {len(devices)} devices; use a multiple of {len(devices)}"
        )
    result = search(run, target, candidates)
    if result.best is None:
        raise NoFitError(result.reason)
    log(result.reason)
    return run_for(given, result.best.candidate)
