"""This project's train step against transformers + PyTorch on the same device, side by side.

    python -m bench.vs_torch_gpu --config=llama3_1b --batch=8 --seq=2048        # one GPU
    python -m bench.vs_torch_gpu --config=tiny --device=cpu --steps=2 --warmup=1  # anywhere

Each row runs in its own child process, one after another, on the same device:

- `jax`: the train step exactly as train_main builds it (`nnx_zoo.launch.build`, the config
  file with --batch / --seq / --override on top, its data pipeline), compiled ahead of time;
- `jax fp8`: the same with `model.quantization=fp8`;
- `torch`: transformers `LlamaForCausalLM` at the same shapes (`zoo.hf_mapping.config_to_hf`
  of the same model), float32 weights, bf16 autocast where the config computes in bf16, fused
  AdamW, SDPA attention, `torch.compile` (on a GPU; on a CPU it is off unless
  --torch_compile=on: too slow to compile there, and the table says `eager`), and on a GPU
  also with activation checkpointing: the table keeps the faster of the two that fit.

The table: step seconds (median of --steps timed steps after --warmup), tokens/s, MFU (model
FLOPs of the config, `DecoderConfig.flops_per_token`, over the device's bf16 peak, the same
for every row), peak memory (the device's allocator; on a CPU JAX reports its compiled step's
peak and torch none) and each row's speed over the torch row's. JAX's rows are packed
documents from the config's data pipeline (document-masked attention); torch's rows are
random tokens under a plain causal mask: the same FLOPs, as the issue's table compared them.

--jax_profile=DIR and --torch_trace=FILE additionally trace two steps of the bf16 rows for
bench/step_breakdown.py (--trace=DIR, --torch_trace=FILE).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from bench.overrides import apply_overrides, shipped_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 2**30


# -- the JAX child ----------------------------------------------------------------------------


def _jax_child(args) -> dict:
    import jax

    from nnx_zoo.launch.build import build
    from nnx_zoo.launch.data import build_data
    from nnx_zoo.training import flops
    from nnx_zoo.training.config import RunConfig
    from nnx_zoo.training.profile import PROGRAM_FILE
    from nnx_zoo.training.step_memory import step_memory

    config = _config(args)
    if args.fp8:
        config.model.quantization = "fp8"
    run = RunConfig.from_config_dict(config)
    built = build(run)
    mesh = built.mesh
    trainer, cfg = built.trainer, built.model_cfg
    with jax.set_mesh(mesh):
        data = build_data(run, mesh, built.batch_spec)
        batches = data.train_batches
        compile_s = trainer.compile(next(batches))
        for _ in range(args.warmup):
            jax.block_until_ready(trainer.train_step(next(batches)))
        times = []
        for _ in range(args.steps):
            batch = next(batches)
            start = time.perf_counter()
            metrics = jax.block_until_ready(trainer.train_step(batch))
            times.append(time.perf_counter() - start)
        if args.jax_profile and not args.fp8:
            with open(os.path.join(_mkdir(args.jax_profile), PROGRAM_FILE), "w") as f:
                f.write(trainer.compiled.as_text())
            jax.profiler.start_trace(args.jax_profile)
            for _ in range(2):
                metrics = trainer.train_step(next(batches))
            jax.block_until_ready(metrics)
            jax.profiler.stop_trace()
        data.close()
    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return {
        "run": "jax fp8" if args.fp8 else "jax",
        "device": device.device_kind,
        "step_s": statistics.median(times),
        "peak_bytes": peak if peak is not None else step_memory(trainer.compiled).peak_bytes,
        "peak_from": "allocator" if peak is not None else "compiled step",
        "compile_s": compile_s,
        "loss": float(metrics["loss"]),
        "flops_per_token": cfg.flops_per_token(run.data.seq_len),
        "peak_flops": flops.peak_flops_per_device(device, dtype=cfg.compute_dtype),
        "compute_dtype": str(cfg.compute_dtype),
        "hf_config": _hf_config(cfg),
        "note": f"{run.model.remat} remat, {run.model.attention_impl} attention",
    }


def _mkdir(path: str) -> str:
    os.makedirs(path, exist_ok=True)
    return path


def _hf_config(cfg) -> dict:
    from zoo.hf_mapping import config_to_hf

    return config_to_hf(cfg)


def _config(args):
    config = shipped_config(args.config, batch=args.batch, seq=args.seq)
    config.checkpoint.enabled = False
    config.logging.progress_bar = False
    apply_overrides(config, args.override)
    return config


# -- the torch child --------------------------------------------------------------------------


def _torch_child(args) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    with open(args.hf_config) as f:
        spec = json.load(f)
    hf = dict(spec["hf_config"])
    hf.pop("architectures", None)
    hf.pop("torch_dtype", None)
    hf.pop("dtype", None)
    cuda = args.device != "cpu"
    device = torch.device("cuda" if cuda else "cpu")
    bf16 = "bfloat16" in spec["compute_dtype"]
    compiled = args.torch_compile == "on" or (args.torch_compile == "auto" and cuda)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**hf, attn_implementation="sdpa"))
    model.to(device=device, dtype=torch.float32).train()
    if args.checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=cuda or None
    )
    step_fn = model
    if compiled:
        step_fn = torch.compile(model)
    batch, seq = spec["batch"], spec["seq"]
    gen = torch.Generator().manual_seed(1)

    def step():
        ids = torch.randint(0, hf["vocab_size"], (batch, seq), generator=gen).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = step_fn(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    def sync():
        if cuda:
            torch.cuda.synchronize()

    start = time.perf_counter()
    for _ in range(max(1, args.warmup)):  # the first step compiles
        loss = step()
    sync()
    compile_s = time.perf_counter() - start
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        loss = step()
        sync()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() if cuda else None
    if args.torch_trace:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(2):
                step()
                sync()
                prof.step()
        prof.export_chrome_trace(args.torch_trace)
    kind = "compile" if compiled else "eager"
    return {
        "run": "torch" + (" +ckpt" if args.checkpointing else ""),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "step_s": statistics.median(times),
        "peak_bytes": peak,
        "peak_from": "allocator" if peak is not None else "-",
        "compile_s": compile_s,
        "loss": float(loss),
        "note": f"transformers {_version('transformers')}, torch {torch.__version__}, {kind}",
    }


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


# -- the parent -------------------------------------------------------------------------------


def _child(args, role: str, extra: list[str]) -> dict | None:
    env = dict(os.environ)
    if args.device == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
        env["CUDA_VISIBLE_DEVICES"] = ""
        if role == "jax":
            from nnx_zoo.runtime.xla_cpu import set_cpu_flags

            set_cpu_flags(env)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    argv = [sys.executable, "-m", "bench.vs_torch_gpu", f"--child={role}", *_common(args), *extra]
    result = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=ROOT)
    rows = [json.loads(x) for x in result.stdout.splitlines() if x.startswith("{")]
    if result.returncode or not rows:
        tail = result.stderr.strip().splitlines()[-1:] or ["no output"]
        print(f"[{role} {' '.join(extra)}] failed: {tail[0][:300]}", file=sys.stderr)
        if "out of memory" in result.stderr.lower() or "RESOURCE_EXHAUSTED" in result.stderr:
            return {"run": role, "error": "out of memory"}
        return {"run": role, "error": tail[0][:200]}
    return rows[0]


def _common(args) -> list[str]:
    out = [f"--config={args.config}", f"--device={args.device}", f"--steps={args.steps}"]
    out += [f"--warmup={args.warmup}", f"--torch_compile={args.torch_compile}"]
    if args.batch:
        out.append(f"--batch={args.batch}")
    if args.seq:
        out.append(f"--seq={args.seq}")
    for override in args.override or []:
        out.append(f"--override={override}")
    return out


def table(rows: list[dict], tokens_per_step: int, jax_row: dict) -> str:
    """The side-by-side table; MFU from the JAX row's model FLOPs and device peak."""
    torch_rows = [r for r in rows if r["run"].startswith("torch") and "error" not in r]
    torch_best = min(torch_rows, key=lambda r: r["step_s"]) if torch_rows else None
    fpt, peak = jax_row.get("flops_per_token"), jax_row.get("peak_flops")
    lines = [
        f"{'run':14} {'tokens/step':>11} {'step s':>8} {'tokens/s':>10} {'MFU':>6} "
        f"{'peak GiB':>8} {'vs torch':>8}  note",
    ]
    lines.append("-" * len(lines[0]))
    for r in rows:
        if "error" in r:
            lines.append(f"{r['run']:14} error: {r['error']}")
            continue
        tps = tokens_per_step / r["step_s"]
        mfu = f"{tps * fpt / peak:6.1%}" if fpt and peak else f"{'-':>6}"
        mem = f"{r['peak_bytes'] / GiB:8.2f}" if r.get("peak_bytes") else f"{'-':>8}"
        ratio = f"{torch_best['step_s'] / r['step_s']:7.2f}x" if torch_best else f"{'-':>8}"
        chosen = " (faster torch)" if r is torch_best and len(torch_rows) > 1 else ""
        note = f"{r.get('note', '')}, peak from {r.get('peak_from', '-')}{chosen}"
        lines.append(
            f"{r['run']:14} {tokens_per_step:>11} {r['step_s']:8.4f} {tps:10,.0f} {mfu} "
            f"{mem} {ratio}  {note}"
        )
    if torch_best:
        jax_ok = [r for r in rows if r["run"] == "jax" and "error" not in r]
        if jax_ok:
            ratio = torch_best["step_s"] / jax_ok[0]["step_s"]
            lines.append(f"ratio: jax (bf16 step) / torch = {ratio:.2f}x the tokens per second")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="llama3_1b", help="configs/<name>.py")
    parser.add_argument("--batch", type=int, help="rows per step (default: the config's)")
    parser.add_argument("--seq", type=int, help="tokens per row (default: the config's)")
    parser.add_argument("--device", default="gpu", choices=("gpu", "cpu"))
    parser.add_argument("--steps", type=int, default=20, help="timed steps (median)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--override", action="append", help="section.field=value (jax rows)")
    parser.add_argument("--no_fp8", action="store_true", help="skip the fp8 row")
    parser.add_argument("--no_torch", action="store_true", help="skip the torch rows")
    parser.add_argument(
        "--torch_compile", default="auto", choices=("auto", "on", "off"), help="auto: on a GPU"
    )
    parser.add_argument(
        "--torch_checkpointing",
        default="auto",
        choices=("auto", "both", "off"),
        help="auto: try with and without on a GPU (the faster that fits counts), off on a CPU",
    )
    parser.add_argument("--jax_profile", help="trace two bf16 steps into this directory")
    parser.add_argument("--torch_trace", help="trace two torch steps into this chrome trace")
    parser.add_argument("--json", action="store_true", help="also print the rows as JSON")
    parser.add_argument("--child", choices=("jax", "torch"), help=argparse.SUPPRESS)
    parser.add_argument("--fp8", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--hf_config", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.child == "jax":
        print(json.dumps(_jax_child(args)), flush=True)
        return
    if args.child == "torch":
        print(json.dumps(_torch_child(args)), flush=True)
        return

    jax_row = _child(args, "jax", [f"--jax_profile={args.jax_profile}"] if args.jax_profile else [])
    rows = [jax_row]
    if not args.no_fp8:
        rows.append(_child(args, "jax", ["--fp8"]))
    if "error" in jax_row:
        print(table(rows, 0, {}))
        sys.exit("the jax row failed; no shapes for the torch peer")
    config = _config(args)
    batch, seq = config.data.global_batch_size, config.data.seq_len
    spec_path = os.path.join(
        os.environ.get("TMPDIR", "/tmp"), f"vs_torch_gpu_{os.getpid()}_hf_config.json"
    )
    with open(spec_path, "w") as f:
        json.dump({**jax_row, "batch": batch, "seq": seq}, f)
    checkpointing = {"auto": [False] if args.device == "cpu" else [False, True]}.get(
        args.torch_checkpointing, [False, True] if args.torch_checkpointing == "both" else [False]
    )
    if args.no_torch:
        checkpointing = []
    for ckpt in checkpointing:
        extra = [f"--hf_config={spec_path}"] + (["--checkpointing"] if ckpt else [])
        if args.torch_trace and not ckpt:
            extra.append(f"--torch_trace={args.torch_trace}")
        rows.append(_child(args, "torch", extra))
    os.remove(spec_path)
    print(f"device: {jax_row['device']}; {args.config}, {batch} x {seq} tokens per step")
    print(table(rows, batch * seq, jax_row))
    if args.json:
        for r in rows:
            print(json.dumps({k: v for k, v in r.items() if k != "hf_config"}))


if __name__ == "__main__":
    main()
