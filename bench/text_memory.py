"""Peak host memory and time to the first step of a tiny run straight from a large JSONL file.

    python -m bench.text_memory [--gb=2] [--num_workers=0,2] [--steps=3]

Writes a synthetic JSONL corpus of `--gb` GB (random words from a fixed-seed vocabulary, lines
of varied length; a 64 MB pool of lines, written in a new order each pass) into a temporary
directory, then runs train_main (configs/tiny.py, `--steps` steps, checkpoints off, one
validation batch at the end) as a child process from it and from
the default source, for each `--num_workers`. While a run lasts its process tree (the child
and its descendants: Grain's worker processes) is polled in /proc and the RSS of its
processes summed; the peak of that sum is the run's peak RSS. The first step's time is when
the run's metrics.jsonl first holds a record, from the child's start. The index cache is off
(`ZOO_DATA_CACHE=off`): every run scans the file, as a first run does. The table says, for
each worker count, whether the JSONL run meets issue 46's goals against the default source's
run (peak RSS within 1 GB, first step within 30 s); `python -m bench.data_scale
--part=text_memory` runs the same measurement.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
from absl import app, flags

from bench.fixtures import STEPS_ONLY, config_flags

_GB = flags.DEFINE_float("gb", 2.0, "size of the JSONL corpus in GB (2**30 bytes)")
_NUM_WORKERS = flags.DEFINE_list("num_workers", ["0", "2"], "data.num_workers of each run")
_STEPS = flags.DEFINE_integer("steps", 3, "training steps per run")
_DIR = flags.DEFINE_string("dir", None, "where to write the corpus (default: a temp dir)")

POOL_BYTES = 64 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_corpus(path: str, size: int, seed: int = 0) -> int:
    """A JSONL file of about `size` bytes; returns its line count. Lines of random words
    (about 150, long-tailed) are made up to POOL_BYTES, then written in a new order each pass
    until `size`: generating every line would take minutes, and repeats cost the reader as
    much as new lines."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    vocab = np.array(["".join(rng.choice(letters, size=n)) for n in rng.integers(2, 11, 5000)])
    pool, pooled = [], 0
    while pooled < min(size, POOL_BYTES):
        lengths = rng.lognormal(4.5, 1.0, size=2000).astype(int) + 1
        words = vocab[rng.integers(0, len(vocab), size=int(lengths.sum()))]
        for ws in np.split(words, np.cumsum(lengths)[:-1]):
            pool.append(json.dumps({"text": " ".join(ws)}) + "\n")
            pooled += len(pool[-1])
    lines, written = 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while written < size:
            order = rng.permutation(len(pool))
            chunk = "".join(pool[i] for i in order)
            f.write(chunk)
            written += len(chunk)
            lines += len(pool)
    return lines


def _tree(root: int) -> list[int]:
    """`root` and its descendants, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def tree_rss(root: int) -> int:
    """RSS in bytes summed over `root` and its descendants (a process tree's memory now)."""
    return sum(_rss(p) for p in _tree(root))


def run(source: str, num_workers: int, workdir: str, steps: int = 3) -> dict:
    args = [
        sys.executable,
        os.path.join(ROOT, "train_main.py"),
        "--config=tiny",
        f"--workdir={workdir}",
        f"--config.data.source={source}",
        f"--config.data.num_workers={num_workers}",
        f"--config.training.steps={steps}",
        *config_flags(STEPS_ONLY),
    ]
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "TF_CPP_MIN_LOG_LEVEL": "3",
        "ZOO_DATA_CACHE": "off",
    }
    metrics = os.path.join(workdir, "metrics.jsonl")
    start = time.perf_counter()
    with open(os.path.join(workdir + ".log"), "w") as log:
        child = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        peak, first_step = 0, None
        while child.poll() is None:
            peak = max(peak, tree_rss(child.pid))
            if first_step is None and os.path.exists(metrics) and os.path.getsize(metrics):
                first_step = time.perf_counter() - start
            time.sleep(0.1)
    if child.returncode != 0:
        with open(workdir + ".log") as f:
            raise SystemExit(f"run failed ({child.returncode}):\n{f.read()[-3000:]}")
    return {
        "peak_gb": peak / 2**30,
        "first_step_s": first_step,
        "total_s": time.perf_counter() - start,
    }


def measure(directory: str, gb: float, num_workers=(0, 2), steps: int = 3, log=print) -> list:
    """Write the corpus into `directory` and run from it and from the default source for
    each worker count; a row per run: (source, workers, `run`'s figures)."""
    corpus = os.path.join(directory, "corpus.jsonl")
    t0 = time.perf_counter()
    lines = write_corpus(corpus, int(gb * 2**30))
    size = os.path.getsize(corpus)
    seconds = time.perf_counter() - t0
    log(f"corpus: {size / 2**30:.2f} GB, {lines:,} lines, written in {seconds:.0f} s")
    rows = []
    for workers in num_workers:
        for name, source in (("default", "default"), (f"{size / 2**30:.2f} GB JSONL", corpus)):
            r = run(source, workers, os.path.join(directory, f"run_{len(rows)}"), steps)
            rows.append((name, workers, r))
            log(f"  {name}, num_workers {workers}: {r}")
    return rows


def report(rows) -> tuple[str, bool]:
    """The markdown table of `measure`'s rows with the goals (issue 46: peak RSS within 1 GB
    of the default source's run, first step within 30 s of it, for each worker count), and
    whether they are met."""
    default = {workers: r for name, workers, r in rows if name == "default"}
    lines = [
        "| source | `num_workers` | peak RSS (process tree) | first step | run | "
        "goal: RSS within 1 GB, first step within 30 s of the default's |",
        "|---|---|---|---|---|---|",
    ]
    ok = True
    for name, workers, r in rows:
        goal = ""
        if name != "default":
            base = default[workers]
            met = (
                r["peak_gb"] - base["peak_gb"] <= 1.0
                and r["first_step_s"] - base["first_step_s"] <= 30
            )
            ok &= met
            goal = (
                f"{r['peak_gb'] - base['peak_gb']:+.2f} GB, "
                f"{r['first_step_s'] - base['first_step_s']:+.1f} s: "
                f"{'met' if met else 'MISSED'}"
            )
        lines.append(
            f"| {name} | {workers} | {r['peak_gb']:.2f} GB | {r['first_step_s']:.1f} s | "
            f"{r['total_s']:.1f} s | {goal} |"
        )
    return "\n".join(lines), ok


def main(argv):
    del argv
    with tempfile.TemporaryDirectory(dir=_DIR.value) as tmp:
        rows = measure(tmp, _GB.value, [int(w) for w in _NUM_WORKERS.value], _STEPS.value)
    print(report(rows)[0], flush=True)


if __name__ == "__main__":
    app.run(main)
