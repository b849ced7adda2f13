"""Training throughput (tokens/s) and MFU of the train step train_main.py runs.

    python -m bench.train_throughput                          # tiny: 1 device, 8 devices x 4
    python -m bench.train_throughput --config=small --steps=5 --strategies=fsdp,fsdp_tp

For each device count a child process is started (the CPU device count is fixed per process
by XLA_FLAGS); it builds the run exactly as train_main.py does (configs/<config>.py, data,
model, optimizer, the jitted donating step), compiles ahead of time, runs `--warmup` steps,
then times `--steps` steps. MFU = tokens/s * config.flops_per_token(T) / (devices * peak);
on CPU the peak is measured (a 2048^2 float32 matmul, nnx_zoo/training/flops.py) unless
`--peak_tflops` is given. Simulated CPU devices share the host's cores, so on CPU the figures
say what the sharding costs in communication and bookkeeping, not what more chips would buy.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from bench.overrides import apply_overrides

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _child(args) -> None:
    import jax

    from nnx_zoo.launch.build import build
    from nnx_zoo.launch.data import build_data
    from nnx_zoo.training import flops
    from nnx_zoo.training.config import RunConfig
    from nnx_zoo.training.step_memory import step_memory

    config_module = __import__(f"configs.{args.config}", fromlist=["get_config"])
    config = config_module.get_config()
    config.checkpoint.enabled = False
    config.logging.progress_bar = False
    if args.peak_tflops:
        config.logging.peak_tflops = args.peak_tflops
    apply_overrides(config, args.override)
    for strategy in args.strategies.split(","):
        config.training.sharding_strategy = strategy
        run = RunConfig.from_config_dict(config)
        try:
            built = build(run)
        except ValueError as e:
            print(json.dumps({"strategy": strategy, "error": str(e)}), flush=True)
            continue
        trainer, cfg, mesh = built.trainer, built.model_cfg, built.mesh
        flops_per_token = cfg.flops_per_token(run.data.seq_len)
        peak = flops.peak_flops_per_device(
            jax.devices()[0], dtype=cfg.compute_dtype, override_tflops=run.logging.peak_tflops
        )
        with jax.set_mesh(mesh):
            batches = build_data(run, mesh, built.batch_spec).train_batches
            compile_s = trainer.compile(next(batches))
            for _ in range(args.warmup):
                jax.block_until_ready(trainer.train_step(next(batches)))
            # Batches are fetched inside the timed loop, as in training (the pipeline is
            # part of the step's cost when it is not hidden).
            start = time.perf_counter()
            for _ in range(args.steps):
                metrics = trainer.train_step(next(batches))
            jax.block_until_ready(metrics)
            elapsed = time.perf_counter() - start
        tokens = args.steps * run.data.global_batch_size * run.data.seq_len
        tps = tokens / elapsed
        n = jax.device_count()
        row = {
            "config": args.config,
            "strategy": strategy,
            "devices": n,
            "mesh": "x".join(f"{k}:{v}" for k, v in mesh.shape.items()),
            "params_M": cfg.num_params() / 1e6,
            "batch": f"{run.data.global_batch_size}x{run.data.seq_len}",
            "step_s": elapsed / args.steps,
            "tokens_per_s": tps,
            "mfu": tps * flops_per_token / (n * peak),
            "peak_tflops_total": n * peak / 1e12,
            "compile_s": compile_s,
            "loss": float(metrics["loss"]),
            **step_memory(trainer.compiled).to_json(),
        }
        print(json.dumps(row), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="tiny", help="configs/<name>.py")
    parser.add_argument("--devices", default="1,8", help="CPU device counts, one child each")
    parser.add_argument("--strategies", default="dp,fsdp,tp,fsdp_tp")
    parser.add_argument("--steps", type=int, default=20, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps after compiling")
    parser.add_argument("--peak_tflops", type=float, default=None)
    parser.add_argument("--override", action="append", help="section.field=value")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args)
        return

    from nnx_zoo.runtime.xla_cpu import set_cpu_flags

    rows = []
    for devices in [int(d) for d in args.devices.split(",")]:
        env = dict(os.environ)
        if os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":
            env["JAX_PLATFORMS"] = "cpu"
            env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
            set_cpu_flags(env)
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        # One device: the strategies coincide (every mesh axis has size 1); run one.
        strategies = "fsdp_tp" if devices == 1 else args.strategies
        argv = [
            sys.executable,
            "-m",
            "bench.train_throughput",
            "--child",
            f"--config={args.config}",
        ]
        argv += [f"--strategies={strategies}", f"--steps={args.steps}"]
        argv += [f"--warmup={args.warmup}"]
        if args.peak_tflops:
            argv.append(f"--peak_tflops={args.peak_tflops}")
        for override in args.override or []:
            argv.append(f"--override={override}")
        result = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=ROOT)
        if result.returncode:
            sys.exit(f"child with {devices} devices failed:\n{result.stderr[-3000:]}")
        rows += [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]

    header = (
        f"{'config':8} {'dev':>3} {'strategy':8} {'mesh':18} {'batch':8} {'step s':>7} "
        f"{'tokens/s':>9} {'MFU':>6} {'peak TF':>7} {'compile s':>9}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        if "error" in r:
            print(f"{args.config:8} {'':>3} {r['strategy']:8} error: {r['error']}")
            continue
        print(
            f"{r['config']:8} {r['devices']:>3} {r['strategy']:8} {r['mesh']:18} {r['batch']:8} "
            f"{r['step_s']:7.3f} {r['tokens_per_s']:9,.0f} {r['mfu']:6.1%} "
            f"{r['peak_tflops_total']:7.3f} {r['compile_s']:9.1f}"
        )
    if rows:
        print(f"\nparams: {rows[0].get('params_M', 0):.2f}M; MFU counts model FLOPs only")


if __name__ == "__main__":
    main()
