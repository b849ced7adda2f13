"""The data goals of issue 46, measured: `--part=store` (the default), `zoo_data`,
`text_memory`, or `all` of them.

    python -m bench.data_scale [--part=store] [--store=DIR | --make_store=DIR] \
        [--processes=1,2,4] [--batches=50] [--batch_size=16] [--seq_len=512]
    python -m bench.data_scale --part=zoo_data [--gb=2] [--zoo_data_workers=2]
    python -m bench.data_scale --part=text_memory [--gb=2] [--train_workers=0,2] [--steps=3]
    python -m bench.data_scale --part=all [--gb=2]     # a store made in a temp dir

`zoo_data` is bench/zoo_data_memory.py's measurement (zoo-data over a `--gb` GB JSONL with a
BPE tokenizer.json: peak RSS of its process tree, tokens/s per worker, the index's counts
against the tokenizer's own), `text_memory` bench/text_memory.py's (a tiny run straight from a
`--gb` GB JSONL against the default source: peak RSS of the process tree and first step), both
imported. The rest of this docstring is the `store` part:

Bytes read and tokens/s per process when N processes read one token store (data/rows.py).

For each N, N python processes (process p of N, no jax.distributed: a pure data bench) each
build the training stream of the store and take the same `--batches` global batches (their
rows of each); each reports `rchar` from /proc/self/io over the data work (from building the
stream to its last batch: the index, the lengths, the chunk indices, the records) and its
tokens/s. The N-process batches, concatenated by process, must equal the one-process batches.
Goal: bytes read per process at N <= 1.3/N of the one-process run's. Then packing quality:
the share of documents split across rows and of padding, for the store's concat-then-split
rows and for the document pipeline's first-fit packer on the same documents.

`--make_store` writes a JSONL of about one epoch of those batches' tokens (documents of
log-normal lengths, median about 350 bytes) and tokenizes it with zoo-data's library code
(byte tokenizer).
Exit status 1 when a check or the goal fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar"))


def _worker(args) -> None:
    """One process of N: its rows of the first `batches` global batches, its bytes and rate."""
    import grain
    from array_record.python import array_record_module  # noqa: F401 -- imported lazily

    from nnx_zoo.data.rows import store_batches

    # Modules the stream imports lazily (the ArrayRecord reader, Grain's prefetch threads)
    # are read from disk once; load them first, so the bytes counted are the data's.
    warm = grain.MapDataset.range(2).to_iter_dataset(grain.ReadOptions(num_threads=2))
    list(warm)
    before, started = _rchar(), time.perf_counter()
    dataset = store_batches(
        args.store,
        "train",
        args.seq_len,
        args.batch_size,
        process_index=args.process_index,
        process_count=args.process_count,
        seed=args.seed,
        num_batches=args.batches,
    )
    batches = list(dataset)
    seconds, read = time.perf_counter() - started, _rchar() - before
    tokens = np.stack([b["tokens"] for b in batches])  # [batches, B/n, T]
    np.save(args.save, tokens)
    print(json.dumps({"bytes": read, "seconds": seconds, "tokens": int(tokens.size)}))


def make_store(directory: str, tokens: int, seed: int = 0) -> str:
    """A JSONL of documents (log-normal word counts, median about 350 bytes) holding at least
    `tokens` bytes, tokenized by zoo-data's library code (byte tokenizer) into a store."""
    from nnx_zoo.data.tokenize_corpus import Request, tokenize_corpus

    rng = np.random.default_rng(seed)
    words = np.array(
        ["the", "of", "and", "to", "in", "data", "model", "token", "row", "batch", "store"]
    )
    os.makedirs(directory, exist_ok=True)
    corpus = os.path.join(directory, "corpus.jsonl")
    written, i = 0, 0
    with open(corpus, "w", encoding="utf-8") as f:
        while written < tokens:
            n = max(1, int(rng.lognormal(np.log(70), 0.8)))
            text = f"{i}: " + " ".join(rng.choice(words, n))
            f.write(json.dumps({"text": text}) + "\n")
            written, i = written + len(text) + 1, i + 1
    out = os.path.join(directory, "store")
    tokenize_corpus(
        Request(source=corpus, tokenizer="byte", out=out, shard_bytes=2**20, overwrite=True),
        log=lambda line: None,
    )
    return out


def _run(args, n: int, scratch: str) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.setdefault("JAX_PLATFORMS", "cpu")
    children = []
    for p in range(n):
        save = os.path.join(scratch, f"{n}-{p}.npy")
        command = [
            sys.executable,
            "-m",
            "bench.data_scale",
            "--worker",
            f"--store={args.store}",
            f"--process_index={p}",
            f"--process_count={n}",
            f"--batches={args.batches}",
            f"--batch_size={args.batch_size}",
            f"--seq_len={args.seq_len}",
            f"--seed={args.seed}",
            f"--save={save}",
        ]
        children.append(
            (
                save,
                subprocess.Popen(
                    command,
                    cwd=ROOT,
                    env=env,
                    text=True,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                ),
            )
        )
    results = []
    for save, child in children:
        out, err = child.communicate(timeout=600)
        if child.returncode:
            raise SystemExit(f"a data process failed:\n{err[-3000:]}")
        results.append({**json.loads(out.strip().splitlines()[-1]), "tokens_BbT": np.load(save)})
    return results


def _packing(args, scratch: str) -> list[tuple[str, float, float]]:
    """(packer, share of documents split across rows, share of padding) over the first
    `batches` training batches, for the store's rows and for the document pipeline's
    first-fit packer on the same documents (the store's, written as one ArrayRecord file)."""
    from nnx_zoo.data import build_dataset, sources
    from nnx_zoo.data.rows import RowLayout, store_batches
    from nnx_zoo.data.token_store import TokenStore
    from nnx_zoo.data.tokenizers import ByteTokenizer

    store = TokenStore(args.store)
    layout = RowLayout(store, "train", args.seq_len, sources.DEFAULT_VALIDATION_FRACTION)
    common = dict(process_index=0, process_count=1, seed=args.seed, num_batches=args.batches)
    rows = store_batches(args.store, "train", args.seq_len, args.batch_size, **common)
    rows_padding = float(np.mean([(b["segment_ids"] == 0).mean() for b in rows]))
    documents = os.path.join(scratch, "documents.arrayrecord")
    sources.write_token_documents(documents, (ids for ids, _ in store.read(range(len(store)))))
    first_fit = build_dataset(
        documents, "train", ByteTokenizer(), args.seq_len, args.batch_size, **common
    )
    first_fit_padding = float(np.mean([(b["segment_ids"] == 0).mean() for b in first_fit]))
    # The chunker splits a document (its ids and EOS) only when it is longer than a row.
    lengths = store.lengths[layout.documents] + 1
    return [
        ("concat-then-split (token store rows)", layout.split_fraction(), rows_padding),
        (
            "first-fit (document pipeline)",
            float(np.mean(lengths > args.seq_len)),
            first_fit_padding,
        ),
    ]


def _store_part(args) -> bool:
    """Bytes read and tokens/s per process, batches checked; packing quality. Whether the
    checks and the goal hold."""
    if args.make_store:
        # One epoch of the training split is about the batches read: the one-process run reads
        # the store once, and the fixed reads (index, lengths, chunk indices) count in full.
        tokens = int(args.batches * args.batch_size * args.seq_len * 1.05)
        args.store = make_store(args.make_store, tokens)
    from nnx_zoo.data.token_store import TokenStore

    counts = [int(n) for n in args.processes.split(",")]
    with tempfile.TemporaryDirectory() as scratch:
        runs = {n: _run(args, n, scratch) for n in counts}
    reference = runs[counts[0]]
    base = np.mean([r["bytes"] for r in reference]) * counts[0]  # one process's bytes
    want = np.concatenate([r["tokens_BbT"] for r in reference], axis=1)
    ok = True
    print(
        f"{args.batches} global batches of {args.batch_size}x{args.seq_len} from {args.store}\n"
        "| processes | process | bytes read (MB) | x one process | goal <= 1.3/N | tokens/s |\n"
        "|---|---|---|---|---|---|"
    )
    for n, results in runs.items():
        got = np.concatenate([r["tokens_BbT"] for r in results], axis=1)
        same = got.shape == want.shape and bool((got == want).all())
        ok &= same
        for p, r in enumerate(results):
            share = r["bytes"] / base
            met = share <= 1.3 / n
            ok &= met
            print(
                f"| {n} | {p} | {r['bytes'] / 1e6:.3f} | {share:.3f} | {1.3 / n:.3f} "
                f"{'met' if met else 'MISSED'} | {r['tokens'] / r['seconds']:,.0f} |"
            )
        print(f"  {n} processes: batches {'equal' if same else 'DIFFER from'} one process's")
    with tempfile.TemporaryDirectory() as scratch:
        packing = _packing(args, scratch)
    median = int(np.median(TokenStore(args.store).lengths)) + 1
    print(
        f"\npacking, seq_len {args.seq_len}, median document {median} tokens with EOS\n"
        "| packer | documents split across rows | padding |\n|---|---|---|"
    )
    for name, split, padding in packing:
        print(f"| {name} | {split:.1%} | {padding:.1%} |")
    return ok


def _zoo_data_part(args) -> bool:
    """zoo-data over a JSONL of --gb GB with a BPE tokenizer (bench/zoo_data_memory.py)."""
    from bench import zoo_data_memory

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        result = zoo_data_memory.measure(
            tmp, args.gb, args.zoo_data_workers, log=lambda line: print(line, flush=True)
        )
    text, ok = zoo_data_memory.report(result)
    print(text, flush=True)
    return ok


def _text_memory_part(args) -> bool:
    """A tiny run from a JSONL of --gb GB against the default source (bench/text_memory.py)."""
    from bench import text_memory

    workers = [int(w) for w in args.train_workers.split(",")]
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        rows = text_memory.measure(
            tmp, args.gb, workers, args.steps, log=lambda line: print(line, flush=True)
        )
    text, ok = text_memory.report(rows)
    print(f"tiny run ({args.steps} steps) from a {args.gb:g} GB JSONL vs the default source")
    print(text, flush=True)
    return ok


PARTS = {"store": _store_part, "zoo_data": _zoo_data_part, "text_memory": _text_memory_part}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", default="store", choices=[*PARTS, "all"])
    parser.add_argument("--store")
    parser.add_argument("--make_store")
    parser.add_argument("--processes", default="1,2,4")
    parser.add_argument("--batches", type=int, default=50)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--seq_len", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gb", type=float, default=2.0, help="the JSONL corpora's size, GB")
    parser.add_argument("--zoo_data_workers", type=int, default=2)
    parser.add_argument("--train_workers", default="0,2", help="data.num_workers of the runs")
    parser.add_argument("--steps", type=int, default=3, help="steps of each tiny run")
    parser.add_argument("--dir", default=None, help="where the corpora go (default: a temp dir)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--process_index", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--process_count", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--save", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    parts = list(PARTS) if args.part == "all" else [args.part]
    if args.part == "store" and not (args.store or args.make_store):
        parser.error("give --store=DIR or --make_store=DIR")
    ok = True
    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        if "store" in parts and not (args.store or args.make_store):
            args.make_store = os.path.join(scratch, "store")
        for i, part in enumerate(parts):
            if i:
                print()
            print(f"== {part} ==", flush=True)
            ok &= PARTS[part](args)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
