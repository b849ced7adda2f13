"""How fast one process builds the global training stream (read, tokenize, chunk, shuffle,
pack, batch), the work every process of a run does whatever the process count
(nnx_zoo/data/pipeline.py: each keeps its rows of every global batch).

    python -m bench.data_throughput [--source=default] [--tokenizer=byte] [--seq_len=2048] \
        [--global_batch_size=16] [--num_workers=0] [--batches=300]

Prints the time per global batch and the tokens per second of one process's pipeline, after
one warm-up batch (worker start-up, filling the first shuffle window of 1024 chunks); the
timed batches should span several windows, or they are served from that first one. A run is
not held up by its data while this rate is above the tokens its step consumes per second (the
run's tokens_per_second, or `data_wait_time` in metrics.jsonl staying near 0).
"""

from __future__ import annotations

import os
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from absl import app, flags  # noqa: E402

_SOURCE = flags.DEFINE_string("source", "default", "data.source")
_TOKENIZER = flags.DEFINE_string("tokenizer", "byte", "data.tokenizer")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 2048, "T")
_BATCH = flags.DEFINE_integer("global_batch_size", 16, "B, rows of the global batch")
_WORKERS = flags.DEFINE_integer("num_workers", 0, "Grain worker processes")
_BATCHES = flags.DEFINE_integer("batches", 300, "global batches timed")


def main(argv):
    del argv
    from nnx_zoo import data
    from nnx_zoo.data.tokenizers import make_tokenizer

    it = data.make_dataset(
        _SOURCE.value,
        "train",
        make_tokenizer(_TOKENIZER.value),
        _SEQ_LEN.value,
        _BATCH.value,
        process_index=0,
        process_count=1,
        num_workers=_WORKERS.value,
    )
    next(it)
    start = time.perf_counter()
    for _ in range(_BATCHES.value):
        next(it)
    seconds = time.perf_counter() - start
    tokens = _BATCHES.value * _BATCH.value * _SEQ_LEN.value
    print(
        f"{_SOURCE.value} / {_TOKENIZER.value}, batch {_BATCH.value}x{_SEQ_LEN.value}, "
        f"{_WORKERS.value} workers: {seconds / _BATCHES.value * 1e3:.1f} ms per global batch, "
        f"{tokens / seconds / 1e3:.0f}k tokens/s per process"
    )
    it.close()


if __name__ == "__main__":
    app.run(main)
