"""One float32 matmul at a time: XLA CPU's default kernel, with the project's flags, and torch.

    pip install "torch==2.14.*"      # not a project extra
    python -m bench.matmul_vs_torch [--rounds=3]

The shapes are the `small` model's (M=768, F=3072, 4x512 = 2048 tokens per step, and one row
for a decode step). Each backend runs in its own process (XLA reads its flags once per
process); the three alternate per round and the 1-minute load average is printed per round.
Figures are GFLOP/s, median over rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (rows, in, out): q/o projections, kv projection, MLP up/gate, MLP down; then a decode step.
SHAPES = [
    (2048, 768, 768),
    (2048, 768, 256),
    (2048, 768, 3072),
    (2048, 3072, 768),
    (1, 768, 3072),
    (1, 3072, 768),
]
CHILD_SECONDS = 0.5  # timed work per shape and round


def _child(backend: str) -> None:
    import time

    import numpy as np

    rng = np.random.default_rng(0)
    if backend == "torch":
        import torch

        def make(m, k, n):
            a, b = torch.from_numpy(rng.standard_normal((m, k), np.float32)), torch.randn(k, n)
            return lambda: a @ b

    else:
        if backend == "xla+flags":
            from nnx_zoo.runtime.xla_cpu import set_cpu_flags

            set_cpu_flags()
        import jax
        import jax.numpy as jnp

        def make(m, k, n):
            a = jnp.asarray(rng.standard_normal((m, k), np.float32))
            b = jnp.asarray(rng.standard_normal((k, n), np.float32))
            f = jax.jit(jnp.dot)
            return lambda: f(a, b).block_until_ready()

    out = {}
    for m, k, n in SHAPES:
        fn = make(m, k, n)
        fn()
        reps = max(3, int(CHILD_SECONDS * 100e9 / (2 * m * k * n)))
        seconds = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            seconds.append(time.perf_counter() - start)
        out[f"{m}x{k}x{n}"] = 2 * m * k * n / statistics.median(seconds) / 1e9
    print(json.dumps(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child)
        return
    backends = ["xla", "xla+flags", "torch"]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="2", ZOO_XLA_CPU_FLAGS="1")
    results = {b: [] for b in backends}
    for r in range(args.rounds):
        order = backends[r % 3 :] + backends[: r % 3]
        print(f"round {r + 1}: load {os.getloadavg()[0]:.2f}", flush=True)
        for b in order:
            argv = [sys.executable, "-m", "bench.matmul_vs_torch", f"--child={b}"]
            done = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=ROOT)
            if done.returncode:
                sys.exit(f"the {b} child failed:\n{done.stderr[-2000:]}")
            results[b].append(json.loads(done.stdout.strip().splitlines()[-1]))
    from nnx_zoo.runtime.xla_cpu import cpu_flags

    print(f"\nGFLOP/s, float32, median of {args.rounds} rounds; xla+flags = {cpu_flags('')}")
    print(f"{'m x k x n':16} {'xla':>8} {'xla+flags':>10} {'torch':>8}")
    for m, k, n in SHAPES:
        key = f"{m}x{k}x{n}"
        row = [statistics.median(run[key] for run in results[b]) for b in backends]
        print(f"{key:16} {row[0]:8.1f} {row[1]:10.1f} {row[2]:8.1f}")


if __name__ == "__main__":
    main()
