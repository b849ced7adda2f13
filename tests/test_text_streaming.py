"""Text sources read lazily (issue 46 item 4): the streamed documents are those the in-memory
reader of earlier versions gave, with the same split; errors still name file:line; the source
pickles to Grain's workers without any text; a corpus larger than a memory cap streams."""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from _train_helpers import ROOT, child_env

from nnx_zoo.data import sources, text_index
from nnx_zoo.data.text_source import DataFileError, TextDocuments

# ----------------------------------------------------------------------------- the reference

# The reader these sources had before they streamed (sources.py at cbed04b), kept as the
# reference: every file read whole into a list of texts.
_OLD_BREAK = re.compile(r"\n[ \t]*\n")


def _old_read(path: str, text_field: str = "text") -> list[str]:
    if path.endswith(".txt"):
        with open(path, "rb") as f:
            text = f.read().decode("utf-8")
        return [p.strip("\n") for p in _OLD_BREAK.split(text) if p.strip()]
    if path.endswith(".jsonl"):
        texts = []
        with open(path, "rb") as f:
            for raw in f:
                line = raw.decode("utf-8")
                if line.strip() and json.loads(line)[text_field]:
                    texts.append(json.loads(line)[text_field])
        return texts
    import pyarrow.parquet as pq

    return [t for t in pq.read_table(path, columns=[text_field])[text_field].to_pylist() if t]


def _old_split(files: list[str], split: str, fraction: float) -> list[str]:
    keyed = [(f"{os.path.basename(p)}:{i}", t) for p in files for i, t in enumerate(_old_read(p))]
    in_val = sources._both_sides([sources._in_validation(k, fraction) for k, _ in keyed])
    return [t for (_, t), keep in zip(keyed, sources._keep(in_val, split), strict=True) if keep]


def _streamed(source: str, split: str = "all", fraction: float = 0.3) -> list[str]:
    docs = sources.load_documents(source, split, validation_fraction=fraction)
    return [docs[i] for i in range(len(docs))]


# ----------------------------------------------------------------------------- corpora

WORDS = ["alpha", "beta", "γάμμα", "日本語", "x", "  ", "\t", "end."]


def _paragraphs_text(rng, n: int, crlf: bool = False) -> str:
    """n paragraphs of varied length between breaks of varied shape (blank lines with spaces
    and tabs, several blank lines, white-space-only paragraphs, non-ASCII-only ones)."""
    parts = []
    for _ in range(n):
        lines = [
            " ".join(rng.choice(WORDS, size=rng.integers(1, 6))) for _ in range(rng.integers(1, 4))
        ]
        parts.append("\n".join(lines))
        parts.append(str(rng.choice(["\n\n", "\n \n", "\n\t \n\n", "\n\n\n\n", "\n  \n  \n"])))
    text = "\n" + "".join(parts) + "  \n"
    return text.replace("\n", "\r\n") if crlf else text


def _write_jsonl(path, rng, n: int) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            kind = rng.integers(0, 10)
            if kind == 0:
                f.write("\n")  # a blank line: no document, no number
            elif kind == 1:
                f.write("   \r\n")
            elif kind == 2:
                f.write(json.dumps({"text": "", "id": i}) + "\n")  # empty: read as no document
            else:
                text = " ".join(rng.choice(WORDS, size=rng.integers(1, 30)))
                f.write(json.dumps({"id": i, "text": text}, ensure_ascii=bool(i % 2)) + "\n")
        f.write(json.dumps({"text": "the last line, no line end"}))
    return str(path)


def _write_parquet(path, rng, n: int) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [
        None if i % 7 == 3 else "" if i % 11 == 5 else " ".join(rng.choice(WORDS, size=3))
        for i in range(n)
    ]
    pq.write_table(pa.table({"text": texts}), path, row_group_size=max(n // 5, 1))
    return str(path)


@pytest.fixture
def corpus(tmp_path):
    rng = np.random.default_rng(0)
    (tmp_path / "a.txt").write_text(_paragraphs_text(rng, 60), encoding="utf-8")
    _write_jsonl(tmp_path / "b.jsonl", rng, 80)
    _write_parquet(tmp_path / "c.parquet", rng, 70)
    return tmp_path


@pytest.mark.parametrize("block", [7, 64, text_index.BLOCK_BYTES])
def test_streamed_documents_are_those_read_whole(corpus, block, monkeypatch):
    """Each file, and the directory (files in order), gives the in-memory reader's documents
    (an empty text reads as '', no document), whatever the block size the index reads in."""
    monkeypatch.setattr(text_index, "BLOCK_BYTES", block)
    files = sorted(str(p) for p in corpus.iterdir())
    for path in files:
        got = _streamed(path)
        assert [t for t in got if t] == _old_read(path), path
    assert [t for t in _streamed(str(corpus)) if t] == [t for p in files for t in _old_read(p)]
    assert _streamed(str(corpus / "[ab].*")) == _streamed(files[0]) + _streamed(files[1])


def test_the_split_is_the_in_memory_readers(tmp_path):
    """Without empty texts the keys are those of before, so the split is too; with them it
    stays deterministic, disjoint and whole."""
    rng = np.random.default_rng(1)
    (tmp_path / "a.txt").write_text(_paragraphs_text(rng, 200), encoding="utf-8")
    with open(tmp_path / "b.jsonl", "w") as f:
        f.writelines(json.dumps({"text": f"doc {i}"}) + "\n" + "\n" * (i % 2) for i in range(300))
    files = [str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")]
    for split in ("train", "validation"):
        want = _old_split(files, split, 0.3)
        assert _streamed(str(tmp_path), split) == want and len(want) > 30
    _write_jsonl(tmp_path / "b.jsonl", rng, 300)  # now with empty texts
    train, val = _streamed(str(tmp_path), "train"), _streamed(str(tmp_path), "validation")
    assert sorted(t for t in train + val if t) == sorted(t for p in files for t in _old_read(p))
    assert _streamed(str(tmp_path), "validation") == val


def test_crlf_paragraphs_are_split_like_lf_ones(tmp_path):
    rng = np.random.default_rng(2)
    text = _paragraphs_text(rng, 40)
    (tmp_path / "lf.txt").write_text(text, encoding="utf-8", newline="")
    (tmp_path / "crlf.txt").write_text(text.replace("\n", "\r\n"), encoding="utf-8", newline="")
    lf = _streamed(str(tmp_path / "lf.txt"))
    assert lf == _old_read(str(tmp_path / "lf.txt"))
    assert _streamed(str(tmp_path / "crlf.txt")) == [t.replace("\n", "\r\n") for t in lf]


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "name, content, message, when",
    [
        (
            "b.jsonl",
            b'{"text": "a"}\n' * 40 + b'{"text": "\xd9"}\n',
            "b.jsonl:41: not UTF-8",
            "start",
        ),
        ("b.txt", b"fine\n\n" * 40 + b"bad \xd9 here\n", "b.txt:81: not UTF-8", "start"),
        (
            "b.jsonl",
            b'{"body": "a"}\n',
            "b.jsonl:1: expected a JSON object with a string field 'text'",
            "start",
        ),
        (
            "b.jsonl",
            b'{"text": "a"}\n\n' * 30 + b'{"text": \n',
            "b.jsonl:61: not valid JSON",
            "read",
        ),
        (
            "b.jsonl",
            b'{"text": "a"}\n' * 30 + b"[1, 2]\n",
            "b.jsonl:31: expected a JSON object",
            "read",
        ),
    ],
)
def test_errors_name_file_and_line(tmp_path, monkeypatch, name, content, message, when):
    """Bad UTF-8 (found by the index, here across its blocks) and the first line's field are
    errors at start; a later line that is not the right JSON when it is read."""
    monkeypatch.setattr(text_index, "BLOCK_BYTES", 50)
    (tmp_path / name).write_bytes(content)
    with pytest.raises(ValueError) as info:
        docs = sources.load_documents(str(tmp_path / name), "all")
        assert when == "read", "the error should have been raised at start"
        [docs[i] for i in range(len(docs))]
    assert message in str(info.value) and "\n" not in str(info.value), str(info.value)
    # Found when read, it is the data's own error (train_main: exit 2 mid-run).
    assert isinstance(info.value, DataFileError) or when == "start"


def test_a_bad_line_found_mid_training_is_exit_2_and_keeps_what_was_saved(tmp_path):
    """A JSONL line read only at step 13 (the training order puts it there): train_main ends
    with exit status 2 and one line naming file:line; metrics.jsonl and the checkpoints
    written before it are whole, and once the line is fixed the same workdir resumes from the
    last checkpoint and finishes."""
    import grain
    from _train_helpers import QUIET_LOGS, SMALL_SHAPES, cli_flags, run_train_main

    count = 3000  # documents of about 12 tokens: some 90 a step of 16 x 64
    # data.validation_source makes the training split all of the file, so the training order
    # of its documents is the shuffle of their numbers: put the bad line at position 1500,
    # past the first window of the pipeline's read-ahead (1024 shuffled chunks).
    bad = list(grain.MapDataset.range(count).shuffle(seed=0))[1500] + 1
    path = tmp_path / "docs.jsonl"
    lines = [json.dumps({"text": f"doc {i} ab"}) for i in range(1, count + 1)]
    good = lines[bad - 1]
    lines[bad - 1] = '{"text": "doc'
    path.write_text("\n".join(lines) + "\n")
    (tmp_path / "held.jsonl").write_text(json.dumps({"text": "held out " * 20}) + "\n")
    workdir = tmp_path / "run"
    flags = {
        **SMALL_SHAPES,
        "data.source": str(path),
        "data.validation_source": str(tmp_path / "held.jsonl"),
        "data.shuffle_seed": 0,
        "training.steps": 16,
        "training.eval_every": 0,
        "training.eval_batches": 1,
        "checkpoint.every": 4,
        **QUIET_LOGS,
    }
    result = run_train_main([f"--workdir={workdir}", *cli_flags(flags)])
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: {path}:{bad}: not valid JSON"), line
    assert "training stopped there; the last complete checkpoint is step 12" in line, line
    with open(workdir / "metrics.jsonl") as f:
        records = [json.loads(text) for text in f]  # every line whole
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 13))
    # The line fixed, the same workdir resumes from step 12 and finishes.
    lines[bad - 1] = good
    path.write_text("\n".join(lines) + "\n")
    resumed = run_train_main([f"--workdir={workdir}", *cli_flags(flags)])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step 12" in resumed.stdout
    with open(workdir / "metrics.jsonl") as f:
        records = [json.loads(text) for text in f]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 17))


def test_every_text_empty_is_no_data_and_an_empty_split_is_named(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text('{"text": ""}\n' * 20)
    with pytest.raises(ValueError, match="holds no documents: every text is empty"):
        sources.load_documents(str(path), "train")
    # One text among empty ones: its split trains; the other side has nothing to validate.
    lines = ['{"text": ""}'] * 20
    train_keys = [i for i in range(20) if not sources._in_validation(f"e.jsonl:{i}", 0.3)]
    lines[train_keys[0]] = '{"text": "the one text"}'
    (tmp_path / "e.jsonl").write_text("\n".join(lines) + "\n")
    assert [t for t in _streamed(str(tmp_path / "e.jsonl"), "train") if t] == ["the one text"]
    with pytest.raises(sources.NoValidationSplitError, match="no text in split 'validation'"):
        sources.load_documents(str(tmp_path / "e.jsonl"), "validation", validation_fraction=0.3)


# ----------------------------------------------------------------------------- workers, cache


def test_the_pickle_carries_offsets_not_texts(tmp_path):
    rng = np.random.default_rng(3)
    path = _write_jsonl(tmp_path / "big.jsonl", rng, 20_000)
    source = sources.load_documents(path, "train")._source
    assert isinstance(source, TextDocuments)
    blob = pickle.dumps(source)
    # About 20 bytes a document; the file is ~8x that.
    assert len(blob) < 24 * len(source) + 4096 < os.path.getsize(path) / 4
    assert b"alpha" not in blob
    copy = pickle.loads(blob)
    assert [copy[i] for i in range(0, len(copy), 97)] == [
        source[i] for i in range(0, len(source), 97)
    ]


def test_the_index_is_cached_outside_the_data_and_rebuilt_when_the_file_changes(
    tmp_path, monkeypatch, capsys
):
    cache = tmp_path / "cache"
    monkeypatch.setenv(text_index.CACHE_ENV, str(cache))
    monkeypatch.setattr(text_index, "CACHE_MIN_BYTES", 0)
    monkeypatch.setattr(text_index, "PROGRESS_AFTER_S", 0.0)  # every scan says so
    data = tmp_path / "data"
    data.mkdir()
    path = _write_jsonl(data / "a.jsonl", np.random.default_rng(4), 50)
    first = _streamed(path)
    assert "data: indexed" in capsys.readouterr().err and len(list(cache.iterdir())) == 1
    assert sorted(os.listdir(data)) == ["a.jsonl"]  # nothing written beside the data
    assert _streamed(path) == first and "data: index" not in capsys.readouterr().err
    with open(path, "a") as f:
        f.write('\n{"text": "one more"}\n')
    assert _streamed(path) == [*first, "one more"] and "data: indexed" in capsys.readouterr().err
    monkeypatch.setenv(text_index.CACHE_ENV, "off")
    assert _streamed(path) == [*first, "one more"] and len(list(cache.iterdir())) == 2


# ----------------------------------------------------------------------------- memory

# The child: the cap, then documents of a corpus larger than it through load_documents and the
# tokenizer (no jax: the data modules only).
_CHILD = textwrap.dedent(
    """
    import resource, sys
    from nnx_zoo.data.sources import load_documents
    from nnx_zoo.data.tokenizers import make_tokenizer

    def data_bytes():
        with open("/proc/self/status") as f:
            line = next(l for l in f if l.startswith("VmData:"))
        return int(line.split()[1]) * 1024

    cap = data_bytes() + int(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_DATA, (cap, resource.RLIM_INFINITY))
    if sys.argv[3] == "whole":  # what the in-memory reader did first
        open(sys.argv[1], "rb").read()
    docs = load_documents(sys.argv[1], "train")
    tok = make_tokenizer("byte")
    n = 0
    for i in range(0, len(docs), max(len(docs) // 3000, 1)):
        n += len(tok.encode(docs[i]))
    print("streamed", len(docs), n)
    """
)
BUDGET = 128 * 2**20  # the index of 250k lines is ~5 MB; the file is twice the budget


def test_a_corpus_larger_than_the_memory_cap_streams(tmp_path):
    path = tmp_path / "big.jsonl"
    line = json.dumps({"text": "lorem ipsum dolor sit amet " * 37}) + "\n"
    with open(path, "w") as f:
        f.write(line * (2 * BUDGET // len(line) + 1))
    assert os.path.getsize(path) > 2 * BUDGET

    def child(mode):
        return subprocess.run(
            [sys.executable, "-c", _CHILD, str(path), str(BUDGET), mode],
            env=dict(child_env(1), **{text_index.CACHE_ENV: "off"}),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )

    streamed = child("stream")
    assert streamed.returncode == 0, streamed.stderr[-3000:]
    assert re.search(r"streamed \d{6} \d+", streamed.stdout), streamed.stdout
    # The cap is real: reading the file whole, as the in-memory reader did, fails under it.
    whole = child("whole")
    assert whole.returncode != 0 and "MemoryError" in whole.stderr, whole.stderr[-2000:]


def test_empty_texts_make_no_tokens_in_the_batches(tmp_path):
    """An empty text reads as '' and the pipeline packs nothing for it (not an EOS alone)."""
    from test_data import _expected_chunks, _segments

    from nnx_zoo import data
    from nnx_zoo.data.tokenizers import ByteTokenizer

    texts = [f"text {i} " * (i % 5 + 1) for i in range(30)]
    lines = [json.dumps({"text": t}) for t in texts]
    for at in (0, 7, 8, 21):
        lines.insert(at, json.dumps({"text": ""}))
    (tmp_path / "e.jsonl").write_text("\n".join(lines) + "\n")
    batches = data.make_dataset(
        str(tmp_path / "e.jsonl"), "all", ByteTokenizer(), 32, 4, process_index=0, process_count=1
    )
    assert sorted(_segments(batches)) == sorted(_expected_chunks(texts, ByteTokenizer(), 32))
