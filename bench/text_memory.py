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
(`ZOO_DATA_CACHE=off`): every run scans the file, as a first run does.
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


def run(source: str, num_workers: int, workdir: str) -> dict:
    args = [
        sys.executable,
        os.path.join(ROOT, "train_main.py"),
        "--config=tiny",
        f"--workdir={workdir}",
        f"--config.data.source={source}",
        f"--config.data.num_workers={num_workers}",
        f"--config.training.steps={_STEPS.value}",
        "--config.training.eval_every=0",
        "--config.training.eval_batches=1",
        "--config.optimizer.warmup_steps=0",
        "--config.checkpoint.enabled=False",
        "--config.logging.log_every=1",
        "--config.logging.progress_bar=False",
        "--config.logging.tensorboard=False",
        "--config.logging.loss_curve=False",
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
            peak = max(peak, sum(_rss(p) for p in _tree(child.pid)))
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


def main(argv):
    del argv
    with tempfile.TemporaryDirectory(dir=_DIR.value) as tmp:
        corpus = os.path.join(tmp, "corpus.jsonl")
        t0 = time.perf_counter()
        lines = write_corpus(corpus, int(_GB.value * 2**30))
        size = os.path.getsize(corpus)
        print(
            f"corpus: {size / 2**30:.2f} GB, {lines:,} lines, written in "
            f"{time.perf_counter() - t0:.0f} s",
            flush=True,
        )
        header = ("source", "num_workers", "peak RSS GB", "first step s", "run s")
        print(" ".join(f"{h:>12}" for h in header), flush=True)
        for workers in map(int, _NUM_WORKERS.value):
            for name, source in (("default", "default"), ("jsonl", corpus)):
                workdir = os.path.join(tmp, f"run_{name}_{workers}")
                r = run(source, workers, workdir)
                print(
                    f"{name:>12} {workers:>12} {r['peak_gb']:>12.2f} {r['first_step_s']:>12.1f} "
                    f"{r['total_s']:>12.1f}",
                    flush=True,
                )


if __name__ == "__main__":
    app.run(main)
