"""zoo-data over a large JSONL with a BPE tokenizer.json: peak RSS, tokens/s per worker, counts.

    python -m bench.zoo_data_memory [--gb=2] [--num_workers=2] [--vocab_size=8192] [--dir=DIR]

Writes a synthetic JSONL corpus of `--gb` GB (bench/text_memory.py's `write_corpus`: random
words of a fixed-seed vocabulary, a 64 MB pool of lines written in a new order each pass),
trains a byte-level BPE tokenizer.json of `--vocab_size` ids on its first 5,000 lines (the
`tokenizers` library), then runs `data_main.py --num_workers=N` over the corpus as a child
process. While it runs, its process tree (the parent and its spawned workers) is polled in
/proc every 0.1 s and the RSS of its processes summed; the peak of that sum is the run's peak
RSS (goal: < 2 GB). zoo-data's own summary line gives the tokens/s of the run and of each
worker.

The check: the store's index.json counts (documents, tokens) against the tokenizer's own
count over the file, made afterwards in a separate streaming pass with `tokenizers.Tokenizer`
itself (not nnx_zoo's wrapper): every non-blank line is parsed and its text encoded (no special
tokens; the store holds ids without EOS), a line seen before counted from a memo of its raw
bytes (each document is encoded alone, so a repeated line has the same count; the corpus
repeats its pool, so this pass tokenizes 64 MB and reads the whole file). Exit status 1 when
the counts differ or the goal is missed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

from bench import text_memory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOAL_BYTES = 2 * 2**30
_SUMMARY = re.compile(r"^tokenized .* tokens/s; per worker (?P<rates>[\d,. ]+) tokens/s")


def train_bpe(corpus: str, out_dir: str, vocab_size: int, lines: int = 5000) -> str:
    """A byte-level BPE tokenizer.json trained on the first `lines` texts of `corpus`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = []
    with open(corpus, encoding="utf-8") as f:
        for line in f:
            texts.append(json.loads(line)["text"])
            if len(texts) >= lines:
                break
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "tokenizer.json")
    tokenizer.save(path)
    return path


def count_tokens(corpus: str, tokenizer_json: str, text_field: str = "text") -> dict:
    """(documents, tokens) of `corpus` by the tokenizer itself, streaming (module docstring)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(tokenizer_json)
    memo: dict[bytes, int] = {}  # raw line -> its tokens (-1: an empty text, no document)
    documents = tokens = 0
    started = time.perf_counter()
    with open(corpus, "rb") as f:
        for raw in f:
            if not raw.strip():
                continue  # a blank line is no document
            count = memo.get(raw)
            if count is None:
                text = json.loads(raw)[text_field]
                count = len(tokenizer.encode(text, add_special_tokens=False).ids) if text else -1
                memo[raw] = count
            if count >= 0:
                documents, tokens = documents + 1, tokens + count
    return {
        "documents": documents,
        "tokens": tokens,
        "seconds": time.perf_counter() - started,
        "distinct_lines": len(memo),
    }


def run_zoo_data(corpus: str, tokenizer_json: str, out: str, num_workers: int, shard_bytes: int):
    """data_main.py as a child, its process tree's RSS polled; (peak bytes, seconds, stderr)."""
    args = [
        sys.executable,
        os.path.join(ROOT, "data_main.py"),
        f"--source={corpus}",
        f"--tokenizer={tokenizer_json}",
        f"--out={out}",
        f"--num_workers={num_workers}",
        f"--shard_bytes={shard_bytes}",
    ]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    log_path = out + ".log"
    started = time.perf_counter()
    with open(log_path, "w") as log:
        child = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        peak = 0
        while child.poll() is None:
            peak = max(peak, text_memory.tree_rss(child.pid))
            time.sleep(0.1)
    seconds = time.perf_counter() - started
    with open(log_path, encoding="utf-8", errors="replace") as f:
        output = f.read()
    if child.returncode != 0:
        raise SystemExit(f"zoo-data failed ({child.returncode}):\n{output[-3000:]}")
    return peak, seconds, output


def measure(
    directory: str, gb: float, num_workers: int = 2, vocab_size: int = 8192, log=print
) -> dict:
    """Write the corpus and tokenizer into `directory`, run zoo-data, count; the figures."""
    corpus = os.path.join(directory, "corpus.jsonl")
    started = time.perf_counter()
    lines = text_memory.write_corpus(corpus, int(gb * 2**30))
    size = os.path.getsize(corpus)
    log(
        f"corpus: {size / 2**30:.2f} GB, {lines:,} lines, written in "
        f"{time.perf_counter() - started:.0f} s"
    )
    tokenizer_json = train_bpe(corpus, os.path.join(directory, "bpe"), vocab_size)
    # Pieces of 128 MiB (zoo-data's default) at full size; at a small size, 8 or more pieces,
    # so every worker has several.
    shard_bytes = min(128 * 2**20, max(2**20, size // 8))
    out = os.path.join(directory, "store")
    peak, seconds, output = run_zoo_data(corpus, tokenizer_json, out, num_workers, shard_bytes)
    summary = next((line for line in output.splitlines() if _SUMMARY.match(line)), None)
    if summary is None:
        raise SystemExit(f"zoo-data printed no tokens/s line:\n{output[-3000:]}")
    rates = [float(r.replace(",", "")) for r in _SUMMARY.match(summary)["rates"].split(", ")]
    log(summary)
    with open(os.path.join(out, "index.json")) as f:
        index = json.load(f)
    reference = count_tokens(corpus, tokenizer_json)
    return {
        "gb": size / 2**30,
        "lines": lines,
        "num_workers": num_workers,
        "vocab_size": vocab_size,
        "peak_bytes": peak,
        "seconds": seconds,
        "worker_rates": rates,
        "summary": summary,
        "index": {"documents": index["documents"], "tokens": index["tokens"]},
        "reference": reference,
    }


def report(result: dict) -> tuple[str, bool]:
    """The markdown table of `measure`'s figures, and whether the check and the goal hold."""
    index, reference = result["index"], result["reference"]
    same = index["documents"] == reference["documents"] and index["tokens"] == reference["tokens"]
    met = result["peak_bytes"] < GOAL_BYTES
    rates = ", ".join(f"{r:,.0f}" for r in result["worker_rates"])
    text = (
        f"zoo-data, {result['gb']:.2f} GB JSONL ({result['lines']:,} lines), byte-level BPE of "
        f"{result['vocab_size']:,} ids, --num_workers={result['num_workers']}\n"
        "| peak RSS (process tree) | goal < 2 GB | wall | tokens/s per worker | "
        "index tokens | tokenizer's own count | documents (index / count) |\n"
        "|---|---|---|---|---|---|---|\n"
        f"| {result['peak_bytes'] / 2**30:.2f} GB | {'met' if met else 'MISSED'} | "
        f"{result['seconds']:.0f} s | {rates} | {index['tokens']:,} | "
        f"{reference['tokens']:,} ({'equal' if same else 'DIFFERENT'}) | "
        f"{index['documents']:,} / {reference['documents']:,} |\n"
        f"  the count: {reference['distinct_lines']:,} distinct lines tokenized, the file read "
        f"whole, in {reference['seconds']:.0f} s"
    )
    return text, same and met


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gb", type=float, default=2.0, help="corpus size, GB (2**30 bytes)")
    parser.add_argument("--num_workers", type=int, default=2)
    parser.add_argument("--vocab_size", type=int, default=8192)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        result = measure(tmp, args.gb, args.num_workers, args.vocab_size)
    text, ok = report(result)
    print(text, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
