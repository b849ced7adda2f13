"""A train step's cost by category: GEMMs, attention, the LM head and loss, norms / rotary /
elementwise, the optimizer update, collectives, the rest, and (from a trace) host gaps.

    # the compiled program, no hardware needed: kernels and memory-bound bytes per step
    python -m bench.step_breakdown --config=llama3_1b --topology=h100:1 --batch=8 --seq=2048
    # a real trace: train_main.py ... --config.logging.profile_steps=5:8 wrote WORKDIR/profile
    python -m bench.step_breakdown --trace=WORKDIR/profile
    # the PyTorch peer's trace (torch.profiler's export_chrome_trace; bench/vs_torch_gpu.py
    # writes one with --torch_trace)
    python -m bench.step_breakdown --torch_trace=peer_trace.json

The compiled view is the one plan_main's forecast counts (`forecast_memory_bytes`,
`forecast_kernels`): the step compiled with one and with two unrolled layers for the target,
each kernel put in a category by nnx_zoo/planning/breakdown.py, the L-layer step
extrapolated. GEMM and attention kernels move bytes the forecast does not count (it times
them by FLOPs), so their bytes column is 0 and the forecast's bytes are its total.

The trace view reads the `*.trace.json.gz` jax.profiler wrote and the compiled program that
train_main writes beside it (`train_step.hlo.txt`): every traced kernel names its HLO
instruction, whose category is the compiled view's. Time per step per category is the sum of
its kernels' durations over the traced steps; `host gaps` is the steps' wall time that no
kernel covers (waiting for input, dispatch, Python). On a CPU the kernels of a step run on
several threads at once, so there the categories can add up to more than the wall time.

The PyTorch view puts GPU kernels (or, on a CPU, the innermost aten ops) in the same
categories by name; the LM head's matmul is a GEMM there (its kernels carry no scope).
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import re
import sys
from collections import defaultdict

from bench.overrides import apply_overrides, shipped_config

HOST_GAPS = "host_gaps"


def _print(title: str, rows: dict[str, dict], columns: list[tuple[str, str, str]]) -> None:
    print(title)
    header = f"{'category':26}" + "".join(f"{name:>14}" for name, _, _ in columns)
    print(header)
    print("-" * len(header))
    for category, row in rows.items():
        cells = "".join(format(row.get(key, 0), fmt).rjust(14) for _, key, fmt in columns)
        print(f"{category:26}{cells}")


# -- the compiled program -------------------------------------------------------------------


def hlo_breakdown(args) -> dict[str, dict]:
    """category -> {kernels, bytes} per step of the run's step compiled for the target."""
    from nnx_zoo.launch import cli

    cli.preamble(huge_pages=False, cpu_only=True)
    from nnx_zoo.launch.build import build
    from nnx_zoo.planning import breakdown
    from nnx_zoo.planning.cli import Request
    from nnx_zoo.planning.cli import build as plan_build
    from nnx_zoo.planning.compile import make_mesh, run_for
    from nnx_zoo.planning.forecast import with_layers

    config = _config(args).to_dict()
    run, target, candidates, _ = plan_build(Request(topology=args.topology, config=config))
    candidate = candidates[0]
    layers = run.model.decoder_config().num_layers
    rows = []
    for n in (1, 2) if layers > 1 else (1,):
        built = build(
            run_for(with_layers(run, n), candidate), make_mesh(target, candidate), abstract=True
        )
        compiled, _ = built.compile()
        rows.append(breakdown.by_category(compiled.as_text()))
    total = breakdown.extrapolate(rows[0], rows[-1], layers) if len(rows) == 2 else rows[0]
    return {c: {"kernels": r.kernels, "bytes": r.bytes / 1e9} for c, r in total.items()}


def _config(args):
    config = shipped_config(args.config, batch=args.batch, seq=args.seq)
    if args.remat:
        config.model.remat = args.remat
    apply_overrides(config, args.override)
    return config


# -- a jax.profiler trace -------------------------------------------------------------------


def _load_trace(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def newest_trace(profile_dir: str) -> str:
    found = glob.glob(os.path.join(profile_dir, "**", "*.trace.json.gz"), recursive=True)
    if not found:
        raise FileNotFoundError(f"no *.trace.json.gz under {profile_dir}")
    return max(found, key=os.path.getmtime)


def _device_pids(events: list[dict]) -> set:
    """Processes that are accelerators (`/device:GPU:0`, `/device:TPU:0`); none on a CPU."""
    return {
        e["pid"]
        for e in events
        if e.get("ph") == "M"
        and e.get("name") == "process_name"
        and str(e.get("args", {}).get("name", "")).startswith("/device:")
    }


def _union_seconds(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total / 1e6  # trace times are microseconds


def _timed_rows(kernels: list[tuple[str, float, float]], steps: int) -> dict[str, dict]:
    """(category, start us, duration us) kernels over `steps` steps -> rows per step."""
    from nnx_zoo.planning.breakdown import CATEGORIES

    seconds: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for category, _, duration in kernels:
        seconds[category] += duration / 1e6
        counts[category] += 1
    spans = [(start, start + duration) for _, start, duration in kernels]
    wall = (max(b for _, b in spans) - min(a for a, _ in spans)) / 1e6 if spans else 0.0
    busy = _union_seconds(spans)
    rows = {
        c: {"seconds": seconds[c] / steps, "kernels": counts[c] / steps, "share": 0.0}
        for c in (*CATEGORIES, *sorted(set(seconds) - set(CATEGORIES)))
    }
    rows[HOST_GAPS] = {"seconds": (wall - busy) / steps, "kernels": 0, "share": 0.0}
    for row in rows.values():
        row["share"] = row["seconds"] / (wall / steps) if wall else 0.0
    rows["step (wall)"] = {"seconds": wall / steps, "kernels": len(kernels) / steps, "share": 1.0}
    return rows


def trace_breakdown(profile_dir: str, program: str | None = None) -> dict[str, dict]:
    """category -> {seconds, kernels, share} per traced train step of a jax.profiler trace."""
    from nnx_zoo.planning.breakdown import instruction_categories
    from nnx_zoo.training.profile import PROGRAM_FILE

    trace = newest_trace(profile_dir)
    program = program or os.path.join(profile_dir, PROGRAM_FILE)
    if not os.path.exists(program):
        raise FileNotFoundError(
            f"{program} is missing: train_main writes the compiled step there when it traces "
            "(--config.logging.profile_steps); pass --program=FILE for another trace"
        )
    with open(program) as f:
        categories = instruction_categories(f.read())
    events = _load_trace(trace)
    devices = _device_pids(events)
    kernels, runs = [], set()
    for e in events:
        args = e.get("args") or {}
        if e.get("ph") != "X" or "train_step" not in str(args.get("hlo_module", "")):
            continue
        if devices and e.get("pid") not in devices:
            continue  # the host's launch events of the same kernels
        op = args.get("hlo_op") or e.get("name", "")
        kernels.append((categories.get(op, "other"), float(e["ts"]), float(e.get("dur", 0))))
        runs.add(args.get("run_id"))
    if not kernels:
        raise ValueError(f"{trace} holds no kernel of a train step (hlo_module *train_step*)")
    return _timed_rows(kernels, max(1, len(runs - {None})))


# -- a torch.profiler trace -----------------------------------------------------------------

# First match wins: GPU kernel names, or on a CPU the aten ops'.
_TORCH_RULES = (
    ("collectives", r"nccl|all_reduce|allreduce|all_gather|reduce_scatter"),
    ("optimizer", r"adam|multi_tensor|foreach|Optimizer\.step"),
    ("lm_head_loss", r"cross_entropy|log_softmax|nll_loss|logsumexp"),
    ("attention", r"flash|fmha|attention|sdpa|_efficient_attention|cudnn"),
    ("gemm", r"gemm|cutlass|xmma|nvjet|cublas|matmul|aten::(mm|addmm|bmm|linear)$|sm90_|sm80_"),
    (
        "norm_rotary_elementwise",
        r"triton_|elementwise|vectorized|reduce|rms|norm|silu|mul|add|cat|neg|pow|rsqrt|mean|sin|cos",
    ),
)


def torch_category(name: str) -> str:
    for category, pattern in _TORCH_RULES:
        if re.search(pattern, name, re.IGNORECASE):
            return category
    return "other"


def _outermost(events: list[dict]) -> list[tuple[str, dict]]:
    """(category, event) for nested CPU events: the outermost event a rule names (an
    `aten::linear` with the `aten::mm` inside it, `Optimizer.step#AdamW.step` with its
    elementwise ops), and innermost events under none that a rule names."""
    out = []
    by_thread: dict[tuple, list[dict]] = defaultdict(list)
    for e in events:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
        stack: list[tuple[float, bool]] = []  # (end, named) of the open ancestors
        for i, e in enumerate(evs):
            while stack and stack[-1][0] <= e["ts"]:
                stack.pop()
            end = e["ts"] + e.get("dur", 0)
            category = torch_category(e["name"])
            inside_named = any(named for _, named in stack)
            has_child = i + 1 < len(evs) and evs[i + 1]["ts"] < end
            if not inside_named and (category != "other" or not has_child):
                out.append((category, e))
            stack.append((end, category != "other" or inside_named))
    return out


def torch_breakdown(path: str, steps: int | None = None) -> dict[str, dict]:
    events = [e for e in _load_trace(path) if e.get("ph") == "X"]
    marks = {e["name"] for e in events if str(e.get("name", "")).startswith("ProfilerStep#")}
    gpu = [(torch_category(e["name"]), e) for e in events if e.get("cat") == "kernel"]
    host = [
        e
        for e in events
        if e.get("cat") in ("cpu_op", "user_annotation") and e["name"] not in marks
    ]
    chosen = gpu or _outermost(host)
    if not chosen:
        raise ValueError(f"{path} holds no GPU kernel and no cpu_op event")
    steps = steps or max(1, len(marks))
    kernels = [(c, float(e["ts"]), float(e.get("dur", 0))) for c, e in chosen]
    return _timed_rows(kernels, steps)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", help="a jax.profiler log dir (WORKDIR/profile)")
    parser.add_argument("--program", help="the traced step's HLO text (default: beside it)")
    parser.add_argument("--torch_trace", help="a torch.profiler chrome trace (.json[.gz])")
    parser.add_argument("--torch_steps", type=int, help="steps in it (default: ProfilerStep#)")
    parser.add_argument("--config", default="llama3_1b", help="configs/<name>.py")
    parser.add_argument("--topology", default="h100:1", help="target to compile for")
    parser.add_argument("--batch", type=int, help="global batch (rows)")
    parser.add_argument("--seq", type=int, help="tokens per row")
    parser.add_argument("--remat", help="remat policy")
    parser.add_argument("--override", action="append", help="section.field=value")
    parser.add_argument("--json", action="store_true", help="one JSON object per table")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    tables = []
    timed = [
        ("ms/step", "seconds_ms", ".2f"),
        ("kernels/step", "kernels", ".0f"),
        ("share", "share", ".1%"),
    ]
    try:
        if args.trace:
            tables.append(("jax.profiler trace", trace_breakdown(args.trace, args.program), timed))
        if args.torch_trace:
            rows = torch_breakdown(args.torch_trace, args.torch_steps)
            tables.append(("torch.profiler trace", rows, timed))
        if not (args.trace or args.torch_trace):
            rows = hlo_breakdown(args)
            title = (
                f"compiled for {args.topology} ({args.config}): kernels and memory-bound GB "
                "per step, as plan_main's forecast counts them"
            )
            tables.append((title, rows, [("kernels", "kernels", ".0f"), ("GB", "bytes", ".2f")]))
    except (OSError, ValueError) as e:
        sys.exit(f"step_breakdown: {e}")
    for title, rows, columns in tables:
        for row in rows.values():
            if "seconds" in row:
                row["seconds_ms"] = row["seconds"] * 1e3
        if args.json:
            print(json.dumps({"table": title, "rows": rows}))
        else:
            _print(title, rows, columns)
            if "bytes" in next(iter(rows.values())):
                total_gb = sum(r["bytes"] for r in rows.values())
                total_k = sum(r["kernels"] for r in rows.values() if r is not rows["collectives"])
                note = "(forecast_kernels, forecast_memory_bytes / 1e9)"
                print(f"{'total':26}{total_k:>14.0f}{total_gb:>14.2f}  {note}")
            print()


if __name__ == "__main__":
    main()
