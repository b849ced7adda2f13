"""A token store's rows (nnx_zoo/data/rows.py): the concat-then-split stream, each process
reading only its rows, batches that concatenate to the one-process batches, the position
resumed on another process count and worker count, the split, and the single evaluation pass.
bench/data_scale.py (separate processes, bytes read) runs at a small size at the end."""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from nnx_zoo import data
from nnx_zoo.data import rows, token_store
from nnx_zoo.data.tokenize_corpus import Request, tokenize_corpus
from nnx_zoo.data.tokenizers import ByteTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BYTE = ByteTokenizer()
SEQ_LEN, BATCH = 32, 8


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """400 documents of 3-84 bytes in 6 shards."""
    rng = np.random.default_rng(0)
    directory = tmp_path_factory.mktemp("rows")
    corpus = directory / "docs.jsonl"
    with open(corpus, "w") as f:
        for i in range(400):
            f.write(json.dumps({"text": f"{i}:" + "ab" * int(rng.integers(0, 40))}) + "\n")
    out = str(directory / "store")
    tokenize_corpus(Request(str(corpus), "byte", out, shard_bytes=4000), log=lambda line: None)
    assert len(token_store.read_index(out)["shards"]) == 6
    return out


def _documents(store) -> list[np.ndarray]:
    opened = token_store.TokenStore(store)
    return [ids for ids, _ in opened.read(range(len(opened)))]


def test_rows_cut_the_documents_stream(store):
    """Rows in order are the documents + EOS, concatenated and cut every T tokens (the last
    padded); segments number the pieces, positions restart in each."""
    stream = np.concatenate([np.append(d, BYTE.eos_id) for d in _documents(store)])
    dataset = rows.store_rows(store, "all", SEQ_LEN, shuffle=False, repeat=False)
    assert len(dataset) == -(-len(stream) // SEQ_LEN)
    got = [dataset[i] for i in range(len(dataset))]
    tokens = np.concatenate([r["tokens"] for r in got])
    np.testing.assert_array_equal(tokens[: len(stream)], stream)
    assert (tokens[len(stream) :] == 0).all()
    for r in got:
        seg, pos = r["segment_ids"], r["positions"]
        real = seg > 0
        assert real[: real.sum()].all()  # padding only at the end
        for s in range(1, seg.max() + 1):
            np.testing.assert_array_equal(pos[seg == s], np.arange((seg == s).sum()))
        ends = np.flatnonzero(r["tokens"] == BYTE.eos_id)
        # A segment ends at its document's EOS, or at the row's end.
        assert all(seg[e + 1] != seg[e] for e in ends if e + 1 < SEQ_LEN and seg[e + 1])
    # Training drops the last partial row and permutes the rest, each epoch anew.
    train = rows.store_rows(store, "all", SEQ_LEN, seed=1)
    epoch = len(stream) // SEQ_LEN
    order = [train[i]["tokens"].tobytes() for i in range(2 * epoch)]
    plain = sorted(r["tokens"].tobytes() for r in got[:epoch])
    assert sorted(order[:epoch]) == plain and sorted(order[epoch:]) == plain
    assert order[:epoch] != order[epoch:]
    assert order[:epoch] != [r["tokens"].tobytes() for r in got[:epoch]]


def _processes(store, n, **kw):
    return [
        data.make_dataset(
            store, "train", BYTE, SEQ_LEN, BATCH, seed=3, process_index=p, process_count=n, **kw
        )
        for p in range(n)
    ]


def _global(iterators):
    local = [next(it) for it in iterators]
    assert all(b["tokens"].shape == (BATCH // len(iterators), SEQ_LEN) for b in local)
    assert all(b[k].dtype == np.int32 for b in local for k in b)
    return {k: np.concatenate([b[k] for b in local]) for k in local[0]}


def _same(got, want):
    assert got.keys() == want.keys() == {"tokens", "segment_ids", "positions"}
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def test_each_process_reads_only_its_rows(store, monkeypatch):
    """1, 2 and 4 processes: the same global batches, and each process reads its rows alone
    (disjoint; together those of one process)."""
    read: dict[int, list[int]] = {}
    mine: set[int] = set()  # readers made by this test (another test's prefetch may still run)
    original, original_init = rows._ReadRow.__call__, rows._ReadRow.__init__

    def made(self, layout):
        original_init(self, layout)
        mine.add(id(self))

    def counting(self, row):
        if id(self) in mine:
            read.setdefault(id(self), []).append(int(row))
        return original(self, row)

    monkeypatch.setattr(rows._ReadRow, "__init__", made)
    monkeypatch.setattr(rows._ReadRow, "__call__", counting)
    steps = 12
    reference = None
    for n in (1, 2, 4):
        read.clear()
        mine.clear()
        iterators = _processes(store, n, num_batches=steps)
        batches = [_global(iterators) for _ in range(steps)]
        if reference is None:
            reference = batches
        for got, want in zip(batches, reference, strict=True):
            _same(got, want)
        per_process = list(read.values())
        assert len(per_process) == n and all(len(r) == steps * BATCH // n for r in per_process)
        everything = [r for rows_read in per_process for r in rows_read]
        assert len(set(everything)) == len(everything) == steps * BATCH  # disjoint, complete
        # Every process keeps the same position: the batch index.
        assert all(it.get_state() == {"batch_index": steps} for it in iterators)


def test_resume_from_four_processes_onto_two(store):
    reference = _processes(store, 1)
    want = [_global(reference) for _ in range(10)]
    four = _processes(store, 4)
    for step in range(4):
        _same(_global(four), want[step])
    state = json.loads(json.dumps(four[0].get_state()))
    assert state == {"batch_index": 4}
    two = _processes(store, 2)
    for it in two:
        it.set_state(state)
    for step in range(4, 10):
        _same(_global(two), want[step])
    with pytest.raises(ValueError, match="not a token store's position"):
        two[0].set_state({"parent": {"documents_read": 3}})


def test_splits_are_disjoint_and_evaluation_has_fixed_batches(store):
    """Train and validation hold different documents; a single pass pads its last batch and
    then yields all-padding batches up to num_batches, the same split over processes."""
    val = rows.RowLayout(token_store.TokenStore(store), "validation", SEQ_LEN, 0.1)
    train = rows.RowLayout(token_store.TokenStore(store), "train", SEQ_LEN, 0.1)
    assert not set(val.documents) & set(train.documents)
    assert len(val.documents) + len(train.documents) == 400 and len(val.documents) > 10
    count = -(-val.num_rows(pad_last=True) // BATCH) + 2

    validation = functools.partial(
        data.make_dataset,
        store,
        "validation",
        BYTE,
        SEQ_LEN,
        BATCH,
        validation_fraction=0.1,
        num_batches=count,
    )
    batches = list(validation(process_index=0, process_count=1))
    assert len(batches) == count
    assert (batches[-1]["segment_ids"] == 0).all() and (batches[0]["segment_ids"] > 0).any()
    real = sum(int((b["segment_ids"] > 0).sum()) for b in batches)
    assert real == val.total_tokens
    two = [validation(process_index=p, process_count=2) for p in range(2)]
    for want in batches:
        _same(_global(two), want)


_WORKERS_SCRIPT = textwrap.dedent(
    """
    import sys
    import numpy as np
    from nnx_zoo import data
    from nnx_zoo.data.tokenizers import ByteTokenizer

    def make(workers, state=None):
        it = data.make_dataset(sys.argv[1], "train", ByteTokenizer(), 32, 8, seed=3,
                               process_index=0, process_count=1, num_workers=workers)
        if state is not None:
            it.set_state(state)
        return it

    if __name__ == "__main__":
        alone, two = make(0), make(2)
        take = lambda it, n: np.stack([next(it)["tokens"] for _ in range(n)])
        np.testing.assert_array_equal(take(alone, 5), take(two, 5))
        assert alone.get_state() == two.get_state() == {"batch_index": 5}, two.get_state()
        want = take(alone, 3)
        moved = make(2, {"batch_index": 5})
        np.testing.assert_array_equal(take(moved, 3), want)
        two.close(); moved.close()
        print("WORKERS_OK")
    """
)


def test_worker_processes_change_neither_the_batches_nor_the_position(store, tmp_path):
    script = tmp_path / "workers.py"
    script.write_text(_WORKERS_SCRIPT)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, str(script), store],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0 and "WORKERS_OK" in proc.stdout, proc.stderr[-3000:]


def _data_scale(*args) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    command = [sys.executable, "-m", "bench.data_scale", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)


def test_data_scale_bench_at_a_small_size(tmp_path):
    """bench/data_scale.py: 1, 2 and 4 processes read the batches of one (checked by the
    bench), and each of N reads less than the one-process run's bytes / N * 1.3 at N=2."""
    proc = _data_scale(
        f"--make_store={tmp_path}", "--batches=20", "--batch_size=8", "--seq_len=512"
    )
    out = proc.stdout
    for n in (1, 2, 4):
        assert f"{n} processes: batches equal one process's" in out, out + proc.stderr[-2000:]
    table = [
        line.split("|") for line in out.splitlines() if line.startswith("| ") and "MB" not in line
    ]
    shares = {}
    for cells in table:
        if len(cells) > 6 and cells[1].strip().isdigit():
            shares.setdefault(int(cells[1]), []).append(float(cells[4]))
    assert max(shares[2]) <= 0.65, out
    assert max(shares[4]) < min(shares[2]), out  # fewer bytes again with more processes
    assert "| concat-then-split (token store rows) |" in out and "| 0.0% |" in out


def test_data_scale_zoo_data_part_at_a_small_size(tmp_path):
    """bench/data_scale.py --part=zoo_data (bench/zoo_data_memory.py) on a 4 MB JSONL: zoo-data
    with a trained BPE tokenizer.json and two workers; the index's token count is the
    tokenizer's own (the bench exits 1 otherwise), and each worker's tokens/s is reported."""
    proc = _data_scale("--part=zoo_data", "--gb=0.004", f"--dir={tmp_path}")
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-2000:]
    row = next(line for line in out.splitlines() if re.match(r"\| [\d.]+ GB \|", line))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[1] == "met" and cells[5].endswith("(equal)"), row
    assert cells[4] == cells[5].split()[0]  # the index's tokens, the tokenizer's count
    assert len(cells[3].split(", ")) == 2 and all(
        float(rate.replace(",", "")) > 0 for rate in cells[3].split(", ")
    ), row
