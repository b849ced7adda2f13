"""Data pipeline: sources, tokenizers, packing invariants, exact resume, worker processes."""

import io
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from nnx_zoo import data
from nnx_zoo.data import sources
from nnx_zoo.data.tokenizers import ByteTokenizer, make_tokenizer
from nnx_zoo.errors import UsageError

BYTE = ByteTokenizer()
TEXT = "Grüße, 世界! def f(x):\n    return x  # ✓"


def _doc_texts(n, seed=0):
    """n distinct documents of varied length, some longer than the rows they are packed into."""
    rng = np.random.default_rng(seed)
    return [f"doc {i}: " + "abcdefgh"[: i % 8] * int(rng.integers(1, 12)) for i in range(n)]


def _write_txt(path, texts):
    path.write_text("\n\n".join(texts) + "\n", encoding="utf-8")
    return str(path)


def _segments(batches):
    """The token ids of every document in every row, checking the packing invariants."""
    docs = []
    for batch in batches:
        assert set(batch) == {"tokens", "segment_ids", "positions"}
        for key in batch:
            assert batch[key].dtype == np.int32
        for tokens, seg, pos in zip(
            batch["tokens"], batch["segment_ids"], batch["positions"], strict=True
        ):
            n_real = int((seg > 0).sum())
            # Padding only at the end of a row, with token 0 and position 0.
            assert (seg[n_real:] == 0).all() and (tokens[n_real:] == 0).all()
            assert (pos[n_real:] == 0).all()
            ids = seg[:n_real]
            if n_real:
                # 1-based and contiguous: 1,1,..,2,2,..,k with no id skipped or repeated later.
                assert ids[0] == 1 and set(np.diff(ids)) <= {0, 1}
            for s in range(1, int(ids.max(initial=0)) + 1):
                where = np.flatnonzero(seg == s)
                np.testing.assert_array_equal(pos[where], np.arange(len(where)))
                docs.append(tuple(tokens[where].tolist()))
    return docs


def _expected_chunks(docs, tokenizer, seq_len):
    """What packing must reproduce: each document's ids + EOS, cut into pieces of <= seq_len."""
    chunks = []
    for doc in docs:
        ids = (tokenizer.encode(doc) if isinstance(doc, str) else list(doc)) + [tokenizer.eos_id]
        chunks += [tuple(ids[i : i + seq_len]) for i in range(0, len(ids), seq_len)]
    return chunks


# ----------------------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trip():
    tok = make_tokenizer("byte")
    ids = tok.encode(TEXT)
    assert max(ids) < 256 and tok.eos_id == 256 and tok.vocab_size == 257
    assert tok.decode(ids + [tok.eos_id]) == TEXT
    assert tok.num_bytes(ids + [tok.eos_id]) == len(TEXT.encode("utf-8"))


def _train_bpe(tmp_path, with_eos=True):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>"] if with_eos else []
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([TEXT, "hello world, hello tokens"] * 20, trainer=trainer)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path, tok


def test_hf_tokenizer_round_trip_and_bytes(tmp_path):
    path, hf = _train_bpe(tmp_path)
    tok = make_tokenizer(str(path))
    assert make_tokenizer(str(tmp_path)).vocab_size == tok.vocab_size  # a directory works too
    ids = tok.encode(TEXT)
    assert len(ids) < len(TEXT.encode())  # merges were learned, so this is not bytes in disguise
    assert tok.eos_id == hf.token_to_id("<|endoftext|>")
    assert tok.vocab_size == hf.get_vocab_size()
    assert tok.decode(ids + [tok.eos_id]) == TEXT
    assert tok.num_bytes(ids + [tok.eos_id]) == len(TEXT.encode("utf-8"))
    # And through the pipeline: packed documents are this tokenizer's ids + its EOS.
    texts = _doc_texts(8)
    source = _write_txt(tmp_path / "docs.txt", texts)
    batches = data.make_dataset(source, "all", tok, 8, 2, process_index=0, process_count=1)
    assert sorted(_segments(batches)) == sorted(_expected_chunks(texts, tok, 8))


def test_hf_tokenizer_without_eos_gets_an_extra_id(tmp_path):
    path, hf = _train_bpe(tmp_path, with_eos=False)
    tok = make_tokenizer(str(path))
    assert tok.eos_id == hf.get_vocab_size() and tok.vocab_size == hf.get_vocab_size() + 1
    assert tok.decode(tok.encode("hello") + [tok.eos_id]) == "hello"


def test_sentencepiece_round_trip(tmp_path):
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(["hello world", "the quick brown fox", TEXT] * 30),
        model_writer=model,
        vocab_size=300,
        byte_fallback=True,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    path = tmp_path / "sp.model"
    path.write_bytes(model.getvalue())
    tok = make_tokenizer(str(path))
    text = "hello quick fox, Grüße"
    ids = tok.encode(text)
    assert tok.decode(ids + [tok.eos_id]) == text
    # SentencePiece counts the space it puts before each text ('▁hello').
    assert tok.num_bytes(ids) - len(text.encode()) in (0, 1)


def test_make_tokenizer_errors_name_the_path(tmp_path):
    missing = str(tmp_path / "nope.json")
    with pytest.raises(UsageError, match="nope.json"):
        make_tokenizer(missing)
    odd = tmp_path / "vocab.bin"
    odd.write_bytes(b"x")
    with pytest.raises(ValueError, match="vocab.bin"):
        make_tokenizer(str(odd))


# ----------------------------------------------------------------------------- sources


def test_default_source_splits_are_disjoint_and_deterministic():
    train = list(sources.load_documents("default", "train"))
    val = list(sources.load_documents("default", "validation"))
    assert len(train) > 100 and 1 <= len(val) < len(train) / 10
    assert not set(train) & set(val)
    for text in val:
        # Real Python source, whole files. compile(), not ast.parse(): CPython 3.11's AST->object
        # conversion can raise "AST constructor recursion depth mismatch" after deep recursion
        # elsewhere in the process (a known interpreter bug), and only the syntax matters here.
        compile(text, "<stdlib>", "exec", dont_inherit=True)
    assert list(sources.load_documents("default", "validation")) == val
    assert sum(len(t) for t in train + val) <= sources.DEFAULT_MAX_BYTES


def test_user_file_formats(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = _doc_texts(6)
    _write_txt(tmp_path / "a.txt", texts[:3])
    with open(tmp_path / "b.jsonl", "w", encoding="utf-8") as f:
        for t in texts[3:]:
            f.write(json.dumps({"body": t, "id": 1}) + "\n")
    pq.write_table(pa.table({"body": texts}), tmp_path / "c.parquet")
    ids = [[1, 2, 3], list(range(40)), [7]]
    sources.write_token_documents(str(tmp_path / "d.arrayrecord"), ids)

    def docs(source):
        return [
            x.tolist() if isinstance(x, np.ndarray) else x
            for x in sources.load_documents(str(source), "all", text_field="body")
        ]

    assert docs(tmp_path / "a.txt") == texts[:3]
    assert docs(tmp_path / "b.jsonl") == texts[3:]
    assert docs(tmp_path / "c.parquet") == texts
    assert docs(tmp_path / "d.arrayrecord") == ids
    assert docs(tmp_path / "[ab].*") == texts  # a glob, files in sorted order
    with pytest.raises(ValueError, match="b.jsonl:1"):
        sources.load_documents(str(tmp_path / "b.jsonl"), "all")  # no 'text' field there
    with pytest.raises(ValueError, match="mixes"):
        sources.load_documents(str(tmp_path), "all", text_field="body")


def test_array_record_batches_carry_the_ids(tmp_path):
    path = str(tmp_path / "toks.array_record")
    docs = [list(range(1, n + 1)) for n in (5, 17, 40, 3)]
    sources.write_token_documents(path, docs)
    batches = list(data.make_dataset(path, "all", BYTE, 16, 4, process_index=0, process_count=1))
    assert sorted(_segments(batches)) == sorted(_expected_chunks(docs, BYTE, 16))
    sources.write_token_documents(path, [[1, 300]])
    with pytest.raises(ValueError, match="300"):
        next(data.make_dataset(path, "all", BYTE, 16, 4, process_index=0, process_count=1))


@pytest.mark.parametrize("name", ["missing.txt", "nothing_*.jsonl", "no_dir/"])
def test_missing_path_raises_naming_it(tmp_path, name):
    source = str(tmp_path / name)
    with pytest.raises(UsageError, match=name.rstrip("/").replace("*", r"\*")):
        data.make_dataset(source, "train", BYTE, 16, 4, process_index=0, process_count=1)


BAD_TEXT_FILES = {
    # name: (file content, what the one-line error must say)
    "null line": ("b.jsonl", b'{"text": "a"}\nnull\n', "b.jsonl:2: expected a JSON object"),
    "list line": ("b.jsonl", b'{"text": "a"}\n\n[1, 2]\n', "b.jsonl:3: expected a JSON object"),
    "malformed line": ("b.jsonl", b'{"text": "a"}\n{"text": \n', "b.jsonl:2: not valid JSON"),
    "unterminated": (
        "b.jsonl",
        b'{"text": "a"}\n{"text": "abc\n',
        "b.jsonl:2: not valid JSON at column 10 (Unterminated string starting at)",
    ),
    "non-utf8 jsonl": ("b.jsonl", b'{"text": "a"}\n{"text": "\xd9"}\n', "b.jsonl:2: not UTF-8"),
    "non-utf8 txt": ("b.txt", b"fine\n\nfine\nbad \xd9 here\n", "b.txt:4: not UTF-8"),
}


@pytest.mark.parametrize("case", list(BAD_TEXT_FILES))
def test_bad_data_file_is_named_with_its_line(tmp_path, case):
    name, content, message = BAD_TEXT_FILES[case]
    _write_txt(tmp_path / "a.txt", _doc_texts(3))  # a good file first: the bad one is named
    (tmp_path / name).write_bytes(content)
    with pytest.raises(ValueError) as info:
        # Bad bytes are found at start; a bad line after the first when it is read.
        docs = sources.load_documents(str(tmp_path / "*"), "all")
        [docs[i] for i in range(len(docs))]
    assert message in str(info.value) and "\n" not in str(info.value), str(info.value)


@pytest.mark.parametrize("fraction", [0.01, 0.99])
def test_the_split_leaves_both_sides_documents(tmp_path, fraction):
    # At 0.01 no key hashes into validation, at 0.99 all do: one document moves across, so
    # no validation_fraction can leave either side empty.
    texts = _doc_texts(3)
    path = _write_txt(tmp_path / "a.txt", texts)
    train = list(sources.load_documents(path, "train", validation_fraction=fraction))
    val = list(sources.load_documents(path, "validation", validation_fraction=fraction))
    assert train and val and sorted(train + val) == sorted(texts)


def test_a_single_document_is_training_data_without_a_validation_split(tmp_path):
    path = _write_txt(tmp_path / "a.txt", _doc_texts(1))
    assert len(sources.load_documents(path, "train", validation_fraction=0.5)) == 1
    with pytest.raises(sources.NoValidationSplitError, match="its one document is the training"):
        sources.load_documents(path, "validation", validation_fraction=0.5)


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("tokenizer.json", b"not json", "not a tokenizer.json"),
        ("tokenizer.json", b'{"version": "1.0"}', "not a tokenizer.json"),
        ("sp.model", b"garbage", "not a SentencePiece model"),
    ],
)
def test_unreadable_tokenizer_file_is_named(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ValueError) as info:
        make_tokenizer(str(path))
    assert str(info.value).startswith(f"{path}: {message}"), str(info.value)
    assert "\n" not in str(info.value)


# ----------------------------------------------------------------------------- pipeline


@pytest.mark.parametrize("shuffle", [False, True])
def test_packing_invariants_and_every_document_once(tmp_path, shuffle):
    texts = _doc_texts(40)
    source = _write_txt(tmp_path / "docs.txt", texts)
    seq_len = 32
    batches = list(
        data.make_dataset(
            source,
            "all",
            BYTE,
            seq_len,
            4,
            seed=3,
            shuffle=shuffle,
            process_index=0,
            process_count=1,
        )
    )
    assert all(b["tokens"].shape == (4, seq_len) for b in batches)
    expected = _expected_chunks(texts, BYTE, seq_len)
    assert any(len(c) == seq_len for c in expected)  # some documents were split
    assert sorted(_segments(batches)) == sorted(expected)
    # Packing fills rows: fewer rows than documents.
    assert len(batches) * 4 < len(expected)


def test_validation_pass_has_fixed_length(tmp_path):
    texts = _doc_texts(10)
    source = _write_txt(tmp_path / "docs.txt", texts)
    kw = dict(process_index=0, process_count=1)
    natural = list(data.make_dataset(source, "all", BYTE, 32, 4, **kw))
    rows = sum(int((b["segment_ids"] > 0).any(axis=1).sum()) for b in natural)
    assert rows % 4  # the last batch is short: it is padded, not dropped
    assert len(natural) == -(-rows // 4)
    assert sorted(_segments(natural)) == sorted(_expected_chunks(texts, BYTE, 32))
    padded = list(data.make_dataset(source, "all", BYTE, 32, 4, num_batches=len(natural) + 2, **kw))
    assert len(padded) == len(natural) + 2
    for want, got in zip(natural, padded[: len(natural)], strict=True):
        np.testing.assert_array_equal(want["tokens"], got["tokens"])
    assert all((b["segment_ids"] == 0).all() for b in padded[len(natural) :])
    assert len(list(data.make_dataset(source, "all", BYTE, 32, 4, num_batches=1, **kw))) == 1


def test_global_batch_must_split_over_the_processes(tmp_path):
    # Which rows each process keeps, and resuming on other counts: test_elastic_data.py.
    source = _write_txt(tmp_path / "docs.txt", _doc_texts(30))
    with pytest.raises(ValueError, match="divisible"):
        data.make_dataset(source, "all", BYTE, 32, 3, process_index=0, process_count=2)


def test_training_stream_is_seeded():
    def first(seed, n=3):
        it = data.make_dataset(
            "default", "train", BYTE, 64, 4, seed=seed, process_index=0, process_count=1
        )
        return np.stack([next(it)["tokens"] for _ in range(n)])

    np.testing.assert_array_equal(first(0), first(0))
    assert not np.array_equal(first(0), first(1))
    limited = data.make_dataset(
        "default", "train", BYTE, 64, 4, num_batches=2, process_index=0, process_count=1
    )
    assert len(list(limited)) == 2


def test_state_round_trip_resumes_exactly():
    def make():
        return data.make_dataset(
            "default",
            "train",
            BYTE,
            64,
            4,
            seed=5,
            process_index=0,
            process_count=1,
            shuffle_window=64,
        )

    it = make()
    for _ in range(7):  # part-way through a packed group and a shuffle window
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    expected = [next(it) for _ in range(20)]
    resumed = make()
    resumed.set_state(state)
    for want in expected:
        got = next(resumed)
        for key in want:
            np.testing.assert_array_equal(got[key], want[key])
    _segments(expected)


_MP_SCRIPT = textwrap.dedent(
    """
    import json
    import sys
    from absl import app
    import numpy as np
    from nnx_zoo import data
    from nnx_zoo.data.position import documents_read, for_workers
    from nnx_zoo.data.tokenizers import ByteTokenizer

    def make(num_workers, state=None):
        it = data.make_dataset(sys.argv[1], "all", ByteTokenizer(), 32, 4, seed=1,
                               shuffle=True, repeat=True, shuffle_window=16,
                               process_index=0, process_count=1, num_workers=num_workers)
        if state is not None:
            it.set_state(json.loads(json.dumps(state)))
        return it

    def take(it, n):
        return np.stack([next(it)["tokens"] for _ in range(n)])

    def main(_):
        alone, two = make(0), make(2)
        np.testing.assert_array_equal(take(alone, 6), take(two, 6))
        # One position for every worker count: it moves on to another count, both ways.
        state = alone.get_state()
        # Odd: the next document is worker 1's, so the workers' turn is part of the position.
        assert two.get_state() == state and documents_read(state) % 2, state
        want = take(alone, 4)
        np.testing.assert_array_equal(take(make(0, two.get_state()), 4), want)
        np.testing.assert_array_equal(take(make(2, state), 4), want)
        # Grain's own state with 2 workers (what earlier versions saved) resumes too.
        np.testing.assert_array_equal(take(make(0, for_workers(state, 2)), 4), want)
        two.close()
        print("MP_OK")

    if __name__ == "__main__":
        app.run(main)
    """
)


def _run_script(script, *args) -> subprocess.CompletedProcess:
    """`python SCRIPT ARGS` as a plain process that imports the checkout."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, env=env, timeout=120
    )


def test_worker_processes_change_neither_the_batches_nor_the_position(tmp_path):
    script = tmp_path / "mp_check.py"
    script.write_text(_MP_SCRIPT)
    source = _write_txt(tmp_path / "docs.txt", _doc_texts(200))
    proc = _run_script(script, source)
    assert proc.returncode == 0 and "MP_OK" in proc.stdout, proc.stderr[-3000:]


_PLAIN_SCRIPT = textwrap.dedent(
    """
    import sys
    from nnx_zoo import data
    from nnx_zoo.data.tokenizers import ByteTokenizer

    # No absl app: a bench, a notebook or a user's own script builds the pipeline like this.
    if __name__ == "__main__":
        it = data.make_dataset(sys.argv[1], "train", ByteTokenizer(), 32, 4,
                               process_index=0, process_count=1, num_workers=2)
        batch = next(it)
        it.close()
        print("PLAIN_OK", sorted(batch), batch["tokens"].shape)
    """
)


def test_worker_processes_start_outside_an_absl_app(tmp_path):
    """Grain reads absl flags as it starts workers; the pipeline marks them parsed itself, so
    a plain Python process (no absl.app.run) reads batches with workers (issue 36 item 4)."""
    script = tmp_path / "plain.py"
    script.write_text(_PLAIN_SCRIPT)
    source = _write_txt(tmp_path / "docs.txt", _doc_texts(50))
    proc = _run_script(script, source)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "PLAIN_OK ['positions', 'segment_ids', 'tokens'] (4, 32)" in proc.stdout, proc.stderr
