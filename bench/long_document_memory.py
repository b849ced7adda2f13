"""Host memory of the training stream's first batch for one single-line document of N MB.

    python -m bench.long_document_memory [--megabytes=0,5,50] [--seq_len=64]

For each size, a child process builds the stream as train_main does (byte tokenizer, batch
16 x seq_len, the document repeating, shuffled) over a `.txt` file of one line of that many
megabytes, takes the first batch, and reports its peak resident memory (ru_maxrss) and the
time. 0 MB is a one-word line: the cost of the imports. nnx_zoo/data/chunking.py keeps the
growth with N to about the text itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

from absl import app, flags

_MEGABYTES = flags.DEFINE_list("megabytes", ["0", "5", "50"], "document sizes in MB")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 64, "T")

_CHILD = """
import resource, sys, time
from nnx_zoo.data.pipeline import make_dataset
from nnx_zoo.data.tokenizers import make_tokenizer
start = time.perf_counter()
it = make_dataset(sys.argv[1], "train", make_tokenizer("byte"), int(sys.argv[2]), 16,
                  process_index=0, process_count=1)
next(it)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, time.perf_counter() - start)
"""


def _write(path: str, megabytes: float) -> None:
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa "
    block = words * (2**16 // len(words))
    with open(path, "w", encoding="utf-8") as f:
        if megabytes == 0:
            f.write("hello\n")
            return
        for _ in range(int(megabytes * 2**20) // len(block)):
            f.write(block)
        f.write("\n")


def main(argv):
    del argv
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "3"}
    print(f"{'document MB':>12} {'peak RSS MB':>12} {'first batch s':>14}")
    with tempfile.TemporaryDirectory() as tmp:
        for mb in _MEGABYTES.value:
            path = os.path.join(tmp, f"{mb}.txt")
            _write(path, float(mb))
            result = subprocess.run(
                [sys.executable, "-c", _CHILD, path, str(_SEQ_LEN.value)],
                capture_output=True,
                text=True,
                env=env,
                check=False,
            )
            if result.returncode:
                print(f"{mb:>12} failed: {result.stderr.strip().splitlines()[-1]}")
                continue
            rss, seconds = (float(v) for v in result.stdout.split())
            print(f"{mb:>12} {rss:>12.0f} {seconds:>14.2f}")


if __name__ == "__main__":
    app.run(main)
