"""Loss curves of model.quantization against the unquantized run, same config, dtype and seed.

    python -m bench.quantization_loss                 # configs/tiny.py, 200 steps, bf16, seed 0
    python -m bench.quantization_loss --dtypes=bfloat16,float32 --seeds=0,1,2
    python -m bench.quantization_loss --steps=100 --quantizations=fp8 --extra=--mesh_shape=data:8

For each compute dtype (`--dtypes`, `model.dtype`: the dtype of everything the quantization
leaves alone, and of the quantized dots' results) and each initialisation seed (`--seeds`,
`training.seed`; the data order is the same for all), runs train_main.py with
`quantization=none` (the reference) and then once per quantization, each in a fresh workdir,
and prints each run's first / last loss, the mean of the last 10 logged losses and its
relative difference from the same dtype and seed's `none` run. With several seeds it then
prints, per dtype and quantization, the mean over seeds and its difference from `none`'s,
beside the spread of the runs over the seeds (max - min over mean; `none`'s is the noise a
difference is to be read against). `--extra` flags go to every run. Exit 1 when a difference
(of the means, with several seeds) exceeds --tolerance (the issue's 2%, against bf16). On CPU
fp8 is emulated (XLA CPU upcasts the fp8 dot to float32 on the fp8 values), int8 runs as an
s32 dot and bf16 is slower than float32: time is not compared.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from statistics import mean

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _losses(workdir: str) -> list[float]:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [r["loss"] for r in map(json.loads, f) if "loss" in r]


def _train(args, env, workdir: str, dtype: str, quantization: str, seed: str) -> list[float]:
    command = [
        sys.executable,
        "train_main.py",
        f"--config={args.config}",
        f"--workdir={workdir}",
        f"--config.training.steps={args.steps}",
        f"--config.training.seed={seed}",
        f"--config.model.dtype={dtype}",
        f"--config.model.quantization={quantization}",
        "--config.checkpoint.enabled=False",
        "--config.logging.progress_bar=False",
        "--config.logging.log_every=1",
        *args.extra,
    ]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{dtype} {quantization} seed {seed}: train_main failed\n{done.stderr[-3000:]}")
    return _losses(workdir)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/tiny.py")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--dtypes", default="bfloat16", help="model.dtype of each comparison")
    parser.add_argument("--seeds", default="0", help="training.seed of each run")
    parser.add_argument("--quantizations", default="fp8,int8")
    parser.add_argument("--tolerance", type=float, default=0.02)
    parser.add_argument("--extra", action="append", default=[], help="more train_main flags")
    args = parser.parse_args()
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    quantizations = ["none", *args.quantizations.split(",")]
    seeds = args.seeds.split(",")
    tails: dict[tuple[str, str], list[float]] = {}  # (dtype, quantization) -> one per seed
    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in args.dtypes.split(","):
            for seed in seeds:
                for q in quantizations:
                    workdir = os.path.join(tmp, f"{dtype}-{seed}-{q}")
                    losses = _train(args, env, workdir, dtype, q, seed)
                    tail = mean(losses[-10:])
                    tails.setdefault((dtype, q), []).append(tail)
                    diff = tail / tails[(dtype, "none")][-1] - 1
                    if len(seeds) == 1:
                        worst = max(worst, abs(diff))
                    print(
                        f"{dtype:8s} seed {seed} {q:5s} loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
                        f"mean of last 10 {tail:.4f} ({diff:+.2%} vs none)",
                        flush=True,
                    )
    if len(seeds) > 1:
        print(f"means over seeds {args.seeds}:")
        for (dtype, q), values in tails.items():
            ref = tails[(dtype, "none")]
            diff = mean(values) / mean(ref) - 1
            worst = max(worst, abs(diff))
            spread = (max(values) - min(values)) / mean(values)
            print(
                f"{dtype:8s} {q:5s} {mean(values):.4f} ({diff:+.2%} vs none; spread over "
                f"seeds {spread:.2%})",
                flush=True,
            )
    return 0 if worst <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
