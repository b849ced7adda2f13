"""The one script a GPU session runs for issue 36: every figure docs/speed.md waits for.

    # on this host first (network): the wheels the GPU image lacks, carried as .whl/
    pip download --no-deps --only-binary=:all: --python-version 3.12 \\
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform any \\
        -d .whl grain ml-collections tensorboardX array-record portpicker
    # on the GPU machine (the device tool: carry=[".whl"]), from the repository root, in two
    # calls of under 10 minutes (stage estimates are guesses until a session prints real ones):
    python -m bench.gpu_session --out=$OUT --stages=env,table,fp8_loss
    python -m bench.gpu_session --out=$OUT --stages=long,8b,unroll,remat_none,xla_flags
    python -m bench.gpu_session --dry-run                  # the commands, nothing run

Stages, in order (--stages picks some; each is skipped, saying so, when what is left of
--budget_s is less than its estimate):

  env         the machine, the GPU, Python, jax, jaxlib, torch, transformers versions
  table       bench/vs_torch_gpu.py at 8 x 2048 (jax, jax fp8, torch + compile with and without
              checkpointing), tracing two steps of each side; then bench/step_breakdown.py
              on both traces
  fp8_loss    train_main, llama3_1b 8 x 2048, 200 steps in bf16 and in fp8: last losses
              and their relative difference (goal: within 2%)
  long        bench/vs_torch_gpu.py at 4 x 8192 (jax, torch + compile)
  8b          llama3_8b at the largest batch plan_main fits on one H200 (16 x 2048, remat
              full, XLA_PYTHON_CLIENT_MEM_FRACTION=0.95): its tokens/s
  unroll      the bf16 step with its 16 layers unrolled (no scan: docs/speed.md)
  remat_none  the bf16 step with remat none (the forecast's 13%-under row)
  xla_flags   the bf16 step with each GPU XLA flag the issue names, one at a time

Everything it prints goes to stdout and, with --out, to OUT/gpu_session.log (the traces and
metrics land under OUT too).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SITE = "/tmp/zoo_site"  # where the carried wheels are installed (not on sys.path by default)
PY = sys.executable

# The GPU XLA flags issue 36 names (each measured alone against the default).
XLA_FLAG_CANDIDATES = (
    "--xla_gpu_enable_triton_gemm=false",
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUDNN,CUSTOM_CALL",
)
LLAMA_1B = ["--config=llama3_1b"]


def stages(out: str) -> dict[str, tuple[int, list[tuple[dict, list[str]]]]]:
    """name -> (estimated seconds, [(extra environment, command)])."""
    vs = [PY, "-m", "bench.vs_torch_gpu", *LLAMA_1B]
    breakdown = [PY, "-m", "bench.step_breakdown"]
    jax_profile, torch_trace = os.path.join(out, "jax_profile"), os.path.join(out, "torch.json")
    train = [
        PY, "train_main.py", "--config=configs/llama3_1b.py", "--config.training.steps=200",
        "--config.data.global_batch_size=8", "--config.data.seq_len=2048",
        "--config.checkpoint.enabled=false", "--config.logging.log_every=50",
        "--config.logging.progress_bar=false", "--config.training.eval_every=0",
    ]  # fmt: skip
    jax_only = [*vs, "--batch=8", "--seq=2048", "--no_torch", "--no_fp8"]
    return {
        "env": (5, [({}, [PY, "-m", "bench.gpu_session", "--env"])]),
        "table": (
            300,
            [
                (
                    {},
                    [
                        *vs,
                        "--batch=8",
                        "--seq=2048",
                        f"--jax_profile={jax_profile}",
                        f"--torch_trace={torch_trace}",
                        "--json",
                    ],
                ),
                ({}, [*breakdown, f"--trace={jax_profile}"]),
                ({}, [*breakdown, f"--torch_trace={torch_trace}"]),
            ],
        ),  # fmt: skip
        "fp8_loss": (
            200,
            [
                ({}, [*train, f"--workdir={os.path.join(out, 'bf16')}"]),
                (
                    {},
                    [
                        *train,
                        f"--workdir={os.path.join(out, 'fp8')}",
                        "--config.model.quantization=fp8",
                    ],
                ),
                ({}, [PY, "-m", "bench.gpu_session", f"--compare_losses={out}"]),
            ],
        ),  # fmt: skip
        "long": (
            150,
            [({}, [*vs, "--batch=4", "--seq=8192", "--no_fp8", "--torch_checkpointing=off"])],
        ),  # fmt: skip
        "8b": (
            150,
            [
                (
                    {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.95"},
                    [
                        PY,
                        "-m",
                        "bench.vs_torch_gpu",
                        "--config=llama3_8b",
                        "--batch=16",
                        "--seq=2048",
                        "--override=model.remat=full",
                        "--override=optimizer.micro_batches=1",
                        "--no_fp8",
                        "--no_torch",
                        "--steps=3",
                        "--warmup=1",
                    ],
                ),
            ],
        ),  # fmt: skip
        "remat_none": (60, [({}, [*jax_only, "--override=model.remat=none"])]),
        # All 16 layers unrolled: no scan stacking (222e9 -> 147e9 bytes counted, 19.2 ->
        # 17.4 GB temp, docs/speed.md); compiles ~2x longer.
        "unroll": (90, [({}, [*jax_only, "--override=model.scan_unroll=16"])]),
        "xla_flags": (
            60 * len(XLA_FLAG_CANDIDATES),
            [({"XLA_FLAGS": flag}, jax_only) for flag in XLA_FLAG_CANDIDATES],
        ),
    }


def _env_with_site() -> dict:
    env = dict(os.environ)
    wheels = glob.glob(os.path.join(ROOT, ".whl", "*.whl"))
    if wheels and not os.path.isdir(SITE):
        subprocess.run(
            [
                PY,
                "-m",
                "pip",
                "install",
                "-q",
                "--no-index",
                "--no-deps",
                "--target",
                SITE,
                *wheels,
            ],
            check=True,
        )
    paths = ([SITE] if os.path.isdir(SITE) else []) + [ROOT, env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


def print_env() -> None:
    from importlib.metadata import PackageNotFoundError, version

    versions = {"python": platform.python_version(), "host": platform.node()}
    for name in ("jax", "jaxlib", "flax", "torch", "transformers", "grain", "ml-collections"):
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = "missing"
    import jax

    versions["devices"] = [d.device_kind for d in jax.devices()]
    print(json.dumps(versions))


def compare_losses(out: str) -> None:
    """The last logged training loss of the bf16 and fp8 runs under OUT, and their gap."""
    last = {}
    for name in ("bf16", "fp8"):
        with open(os.path.join(out, name, "metrics.jsonl")) as f:
            records = [json.loads(line) for line in f if '"loss"' in line]
        last[name] = records[-1]
    gap = abs(last["fp8"]["loss"] - last["bf16"]["loss"]) / last["bf16"]["loss"]
    print(
        f"fp8 vs bf16 after {last['fp8']['step']} steps: loss {last['fp8']['loss']:.4f} vs "
        f"{last['bf16']['loss']:.4f} ({gap:.2%}; goal within 2%); tokens/s "
        f"{last['fp8'].get('tokens_per_second', 0):,.0f} vs "
        f"{last['bf16'].get('tokens_per_second', 0):,.0f}"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/gpu_session"))
    parser.add_argument(
        "--stages", default="env,table,fp8_loss,long,8b,unroll,remat_none,xla_flags"
    )
    # The device tool allows 600 s per command: leave room for start-up and the copy back.
    parser.add_argument("--budget_s", type=float, default=560.0)
    parser.add_argument("--dry-run", dest="dry_run", action="store_true")
    parser.add_argument("--env", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--compare_losses", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.env:
        print_env()
        return
    if args.compare_losses:
        compare_losses(args.compare_losses)
        return
    table = stages(args.out)
    chosen = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in table]
    if unknown:
        sys.exit(f"--stages: unknown {', '.join(unknown)}; valid: {', '.join(table)}")
    if args.dry_run:
        for name in chosen:
            seconds, commands = table[name]
            print(f"# {name} (~{seconds} s)")
            for extra, command in commands:
                prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in extra.items())
                print((prefix + " " if prefix else "") + shlex.join(command))
        return
    os.makedirs(args.out, exist_ok=True)
    log = open(os.path.join(args.out, "gpu_session.log"), "a")  # noqa: SIM115

    def say(text: str) -> None:
        print(text, flush=True)
        log.write(text + "\n")
        log.flush()

    env = _env_with_site()
    start = time.perf_counter()
    for name in chosen:
        seconds, commands = table[name]
        left = args.budget_s - (time.perf_counter() - start)
        if seconds > left:
            say(f"## {name}: skipped (~{seconds} s, {left:.0f} s of the budget left)")
            continue
        say(f"## {name} (at {time.perf_counter() - start:.0f} s)")
        for extra, command in commands:
            say("$ " + " ".join(f"{k}={v}" for k, v in extra.items()) + " " + shlex.join(command))
            result = subprocess.run(
                command, cwd=ROOT, env={**env, **extra}, capture_output=True, text=True
            )
            say(result.stdout.rstrip())
            if result.returncode:
                say(f"exit {result.returncode}: " + result.stderr.strip()[-2000:])
    say(f"## done in {time.perf_counter() - start:.0f} s")
    log.close()


if __name__ == "__main__":
    main()
