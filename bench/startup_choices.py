"""What the CPU start-up choices buy, on train_main's own train step: the XLA CPU flag
(ZOO_XLA_CPU_FLAGS=1, nnx_zoo/runtime/xla_cpu.py) and huge pages for the host allocator
(ZOO_HUGE_PAGES=1, nnx_zoo/runtime/cpu_memory.py), each and both against the defaults
(neither).

    python -m bench.startup_choices [--config=small] [--batch=4] [--seq=512] [--steps=4]
        [--rounds=2]

Each variant is a train_main process of its own (XLA reads its flags and glibc its tunables
once per process) on one CPU device; the variants alternate in each round. Per variant: the
median step time of the steps after the first (metrics.jsonl's `step_time`, compile
excluded), and the whole process's system CPU seconds and minor page faults (where huge
pages act). The 1-minute load average is printed per run: a figure is only worth its load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from bench.fixtures import STEPS_ONLY, config_flags  # noqa: E402

# name -> environment over the user's (less ours): the defaults, the flag, huge pages.
VARIANTS = {
    "defaults": {},
    "ZOO_XLA_CPU_FLAGS=1": {"ZOO_XLA_CPU_FLAGS": "1"},
    "ZOO_HUGE_PAGES=1": {"ZOO_HUGE_PAGES": "1"},
    "both": {"ZOO_XLA_CPU_FLAGS": "1", "ZOO_HUGE_PAGES": "1"},
}


def _run(args, extra: dict) -> dict:
    ours = ("XLA_FLAGS", "GLIBC_TUNABLES", *(k for v in VARIANTS.values() for k in v))
    env = {k: v for k, v in os.environ.items() if k not in ours}
    env.update(JAX_PLATFORMS="cpu", **extra)
    with tempfile.TemporaryDirectory() as workdir:
        command = [
            sys.executable,
            os.path.join(ROOT, "train_main.py"),
            f"--config={args.config}",
            f"--workdir={workdir}/run",
            f"--config.data.global_batch_size={args.batch}",
            f"--config.data.seq_len={args.seq}",
            f"--config.training.steps={args.steps}",
            *config_flags(STEPS_ONLY),
            "--config.logging.peak_tflops=1",  # no start-up matmul to measure the peak
        ]
        load = os.getloadavg()[0]
        proc = subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
        _, status, usage = os.wait4(proc.pid, 0)
        if os.waitstatus_to_exitcode(status):
            sys.exit(f"train_main failed ({' '.join(f'{k}={v}' for k, v in extra.items())})")
        with open(os.path.join(workdir, "run", "metrics.jsonl")) as f:
            steps = [json.loads(line) for line in f]
    times = [r["step_time"] for r in steps if "step_time" in r][1:]
    return dict(
        step=statistics.median(times), sys=usage.ru_stime, faults=usage.ru_minflt, load=load
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="small")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated")
    args = parser.parse_args()
    names = args.variants.split(",")
    if not set(names) <= set(VARIANTS):
        parser.error(f"--variants: each of {', '.join(VARIANTS)}")
    found = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            result = _run(args, VARIANTS[name])
            found[name].append(result)
            print(
                f"round {r + 1} {name:18} step {result['step']:7.2f} s, "
                f"sys {result['sys']:6.1f} s, {result['faults']:>9,} minor faults, "
                f"load {result['load']:.2f}",
                flush=True,
            )
    print(f"\n{args.config}, batch {args.batch}x{args.seq}, 1 CPU device, {os.cpu_count()} cores")
    print(f"{'variant':18} {'step s':>8} {'sys s':>7} {'minor faults':>13}")
    for name in names:
        runs = found[name]
        print(
            f"{name:18} {statistics.median(r['step'] for r in runs):8.2f} "
            f"{statistics.median(r['sys'] for r in runs):7.1f} "
            f"{statistics.median(r['faults'] for r in runs):13,.0f}"
        )


if __name__ == "__main__":
    main()
