"""zoo-data (data_main.py, nnx_zoo/data/tokenize_corpus.py) and the token store it writes
(nnx_zoo/data/token_store.py): the index's counts against the tokenizer's own over the input,
a killed run resumed, a non-empty --out refused, a store as data.source (text and
prompt_completion), the tokenizer check, and train_main straight from a store."""

from __future__ import annotations

import json
import os
import shutil

import _entry
import numpy as np
import pytest
from _train_helpers import QUICK_RUN, cli_flags, run_train_main, train_losses

from nnx_zoo import data
from nnx_zoo.data import sources, token_store
from nnx_zoo.data.tokenizers import ByteTokenizer, make_tokenizer

# Paragraph breaks of every kind the whole-file split knows (blank lines with spaces or tabs,
# runs of them, a whitespace line after a break), so pieces cut inside the file must find the
# documents the whole file gives.
_PARAGRAPHS = [
    "first paragraph\nits second line",
    "Grüße, 世界 ✓",
    "  indented start",
    "after a tab break",
    "x" * 300,
]
_TXT = "\n\n".join(_PARAGRAPHS[:3]) + "\n \t\n" + _PARAGRAPHS[3] + "\n\n\n\n" + _PARAGRAPHS[4]


def _corpus(directory) -> str:
    """A directory of .jsonl, .txt and .parquet files, some larger than the pieces."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "a.jsonl"), "w", encoding="utf-8") as f:
        for i in range(120):
            f.write(json.dumps({"text": f"doc {i} " + "héllo " * int(rng.integers(0, 30))}) + "\n")
            if i % 17 == 0:
                f.write("\n")  # blank lines are no documents
        f.write(json.dumps({"text": ""}) + "\n")  # an empty text is no document either
    with open(os.path.join(directory, "b.txt"), "w", encoding="utf-8") as f:
        f.write("\n\n".join([_TXT] * 6) + "\n")
    texts = [f"row {i}: " + "abc " * int(rng.integers(1, 20)) for i in range(90)]
    pq.write_table(
        pa.table({"text": texts}), os.path.join(directory, "c.parquet"), row_group_size=20
    )
    return str(directory)


def _zoo_data(args) -> _entry.Result:
    return _entry.run_main("data_main", args)


def _records(store: str) -> list[list[int]]:
    opened = token_store.TokenStore(store)
    return [ids.tolist() for ids, _ in opened.read(range(len(opened)))]


def _bpe(tmp_path) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["doc héllo row abc paragraph"] * 50 + _PARAGRAPHS, trainer=trainer)
    path = tmp_path / "bpe" / "tokenizer.json"
    path.parent.mkdir()
    tok.save(str(path))
    return str(path)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return _corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def store(corpus, tmp_path_factory) -> str:
    """The corpus with the byte tokenizer in small pieces, one worker (in this process)."""
    out = str(tmp_path_factory.mktemp("stores") / "byte")
    result = _zoo_data(
        [
            f"--source={corpus}",
            "--tokenizer=byte",
            f"--out={out}",
            "--shard_bytes=700",
            "--num_workers=1",
        ]
    )
    assert result.returncode == 0, result.stderr
    return out


def test_index_counts_equal_the_tokenizers_own_count(corpus, tmp_path):
    bpe = _bpe(tmp_path)
    out = str(tmp_path / "store")
    result = _zoo_data(
        [
            f"--source={corpus}/*",
            f"--tokenizer={bpe}",
            f"--out={out}",
            "--shard_bytes=500",
            "--num_workers=1",
        ]
    )
    assert result.returncode == 0, result.stderr
    tokenizer = make_tokenizer(bpe)
    documents = list(sources.load_documents(f"{corpus}/*", "all"))  # what a run would read
    # An empty text is read as '' (its number keeps the split) and becomes no tokens.
    want = [tokenizer.encode(text) for text in documents if text]
    with open(os.path.join(out, "index.json")) as f:
        index = json.load(f)
    assert index["documents"] == len(want) and index["tokens"] == sum(map(len, want))
    assert _records(out) == want  # in corpus order, the pieces of each file in byte order
    assert len(index["shards"]) > 5  # the big files were cut into several pieces
    assert index["tokenizer"] == token_store.tokenizer_identity(tokenizer, bpe)
    assert [s["bytes"] for s in index["sources"]] == [
        os.path.getsize(os.path.join(corpus, n)) for n in ("a.jsonl", "b.txt", "c.parquet")
    ]
    # Progress on stderr, the figures at the end, the summary on stdout.
    assert "documents" in result.stderr and "tokens/s per worker" not in result.stderr
    assert "per worker" in result.stderr and "tokens/s" in result.stderr
    assert f"wrote {len(want):,} documents" in result.stdout


def test_a_killed_run_resumes_to_the_same_store(corpus, store, tmp_path):
    """A run killed after some shards (no index.json, some done markers missing, a partial
    temporary file) continues with two worker processes and writes the same store."""
    out = str(tmp_path / "resumed")
    shutil.copytree(store, out)
    os.remove(os.path.join(out, "index.json"))
    done = sorted(n for n in os.listdir(out) if n.endswith(".done"))
    for name in done[1::2]:
        os.remove(os.path.join(out, name))
    with open(os.path.join(out, ".tmp-shard-00003.arrayrecord"), "wb") as f:
        f.write(b"half")
    assert not token_store.is_store(out)
    result = _zoo_data(
        [
            f"--source={corpus}",
            "--tokenizer=byte",
            f"--out={out}",
            "--shard_bytes=700",
            "--num_workers=2",
        ]
    )
    assert result.returncode == 0, result.stderr
    assert f"continuing: {len(done) - len(done[1::2])} of {len(done)} shards" in result.stderr
    with open(os.path.join(out, "index.json")) as f, open(os.path.join(store, "index.json")) as g:
        assert json.load(f) == json.load(g)
    assert _records(out) == _records(store)
    assert not [n for n in os.listdir(out) if n.startswith(".tmp-")]


def _exit_2(result, *parts):
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    for part in parts:
        assert part in line, line


def test_a_non_empty_out_is_refused(corpus, store, tmp_path):
    args = [f"--source={corpus}", "--tokenizer=byte", "--shard_bytes=700", "--num_workers=1"]
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    _exit_2(_zoo_data([*args, f"--out={foreign}"]), "holds files zoo-data did not write")
    _exit_2(_zoo_data([*args, f"--out={foreign}", "--overwrite"]), "notes.txt")
    assert (foreign / "notes.txt").read_text() == "mine"
    finished = str(tmp_path / "finished")
    shutil.copytree(store, finished)
    _exit_2(_zoo_data([*args, f"--out={finished}"]), "already holds a finished token store")
    # An unfinished run of other arguments is not continued.
    os.remove(os.path.join(finished, "index.json"))
    other = [a.replace("--shard_bytes=700", "--shard_bytes=900") for a in args]
    _exit_2(_zoo_data([*other, f"--out={finished}"]), "unfinished zoo-data run", "shard_bytes")
    result = _zoo_data([*other, f"--out={finished}", "--overwrite"])
    assert result.returncode == 0 and token_store.is_store(finished), result.stderr
    _exit_2(_zoo_data(["--source=/no/such/file.jsonl", f"--out={tmp_path / 'x'}"]), "/no/such")


def test_overwrite_keeps_the_old_store_until_the_new_one_is_whole(corpus, store, tmp_path):
    """--overwrite of a finished store that fails half-way (a bad record in the second
    file) leaves the old store readable and whole; one that succeeds replaces it."""
    finished = str(tmp_path / "finished")
    shutil.copytree(store, finished)
    before = _records(finished)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "a.jsonl").write_text("".join(json.dumps({"text": f"ok {i}"}) + "\n" for i in range(30)))
    (bad / "b.jsonl").write_text('{"text": "fine"}\n{not json\n')
    args = ["--tokenizer=byte", "--shard_bytes=200", "--num_workers=1", "--overwrite"]
    result = _zoo_data([f"--source={bad}", f"--out={finished}", *args])
    assert result.returncode == 2, result.stderr
    assert _records(finished) == before
    assert sorted(os.listdir(tmp_path)) == ["bad", "finished"]  # no half-made store beside it
    good = tmp_path / "good"
    good.mkdir()
    (good / "a.jsonl").write_text(json.dumps({"text": "only this"}) + "\n")
    result = _zoo_data([f"--source={good}", f"--out={finished}", *args])
    assert result.returncode == 0, result.stderr
    assert _records(finished) == [list(b"only this")]
    assert sorted(os.listdir(tmp_path)) == ["bad", "finished", "good"]


def test_a_text_store_is_a_source_like_its_text(corpus, store):
    """load_documents reads the store's documents, split by the ArrayRecord hash; its
    records are the byte ids of the corpus's documents."""
    byte = ByteTokenizer()
    want = [byte.encode(t) for t in sources.load_documents(corpus, "all") if t]  # '' is none
    assert [d.tolist() for d in sources.load_documents(store, "all")] == want
    train = sources.load_documents(store, "train")
    validation = sources.load_documents(store, "validation")
    assert len(train) + len(validation) == len(want) and len(validation) > 0


def test_prompt_completion_store_gives_the_batches_of_its_records(tmp_path):
    source = tmp_path / "pc.jsonl"
    with open(source, "w") as f:
        for i in range(40):
            f.write(json.dumps({"prompt": f"q{i}? " * (i % 5 + 1), "completion": f"a{i}."}) + "\n")
    out = str(tmp_path / "pc")
    result = _zoo_data(
        [f"--source={source}", f"--out={out}", "--format=prompt_completion", "--num_workers=1"]
    )
    assert result.returncode == 0, result.stderr
    # 'all': the store's split hashes record numbers, the file's its `name:line` keys.
    common = dict(
        split="all",
        shuffle=True,
        repeat=True,
        tokenizer=ByteTokenizer(),
        seq_len=32,
        global_batch_size=4,
        data_format="prompt_completion",
        process_index=0,
        process_count=1,
    )
    want = list(data.build_dataset(str(source), num_batches=5, **common))
    got = list(data.build_dataset(out, num_batches=5, **common))
    assert len(got) == 5 and set(got[0]) == {"tokens", "segment_ids", "positions", "loss_mask"}
    for g, w in zip(got, want, strict=True):
        for key in w:
            np.testing.assert_array_equal(g[key], w[key], err_msg=key)
    with pytest.raises(ValueError, match="holds prompt_completion data"):
        data.build_dataset(out, "train", ByteTokenizer(), 32, 4, process_index=0, process_count=1)


def test_train_main_reads_a_store_and_refuses_another_tokenizer(store, tmp_path):
    result = run_train_main(
        [f"--workdir={tmp_path / 'run'}", *cli_flags({**QUICK_RUN, "data.source": store})]
    )
    assert result.returncode == 0, result.stderr[-3000:]
    losses = train_losses(str(tmp_path / "run"))
    assert len(losses) == 3 and all(np.isfinite(losses))
    bpe = _bpe(tmp_path)
    result = run_train_main(
        [
            f"--workdir={tmp_path / 'other'}",
            *cli_flags({**QUICK_RUN, "data.source": store, "data.tokenizer": bpe}),
        ]
    )
    _exit_2(result, f"data.source={store!r} was tokenized with 'byte' (vocab 257", bpe, "vocab 300")


def test_zoo_data_flags(corpus, tmp_path):
    result = _zoo_data(["--help"])
    assert result.returncode == 0 and "--shard_bytes" in result.stdout
    _exit_2(_zoo_data([f"--source={corpus}"]), "--out is required")
    _exit_2(_zoo_data([f"--source={corpus}", f"--out={tmp_path}", "--format=csv"]), "--format")
    _exit_2(
        _zoo_data([f"--source={corpus}", f"--out={tmp_path / 'o'}", "--num_workers=0"]),
        "--num_workers and --shard_bytes must be at least 1",
    )
