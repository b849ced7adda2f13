"""Chat data that trains nothing is an error, and a conversation longer than seq_len is never
split into rows (issue 40, item 2): `data.chat_overflow=drop|truncate_left|error`.

On 9d09506 a source whose conversations hold no assistant turn trained (exit 0, loss 0, no
message), and a long conversation was cut into rows, each its own segment from position 0,
so its answer trained without its prompt in context.
"""

from __future__ import annotations

import json
import re

import _entry
import numpy as np
import pytest
from _train_helpers import SMALL_RUN, cli_flags
from chat_fixtures import write_tokenizer_dir

from nnx_zoo import data
from nnx_zoo.data.chat import ChatTemplate, encode_record
from nnx_zoo.data.tokenizers import make_tokenizer

SEQ = 64


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return write_tokenizer_dir(str(tmp_path_factory.mktemp("llama3_tok")), "llama3")


def _chat(question: str, answer: str | None) -> dict:
    messages = [{"role": "user", "content": question}]
    if answer is not None:
        messages.append({"role": "assistant", "content": answer})
    return {"messages": messages}


def _write(path, records) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return str(path)


def _rows(source, tok_dir, overflow: str, notes: list | None = None):
    """Every row of the 'all' split, in file order: (tokens, segment_ids, positions, mask)."""
    batches = data.build_dataset(
        source,
        "all",
        make_tokenizer(tok_dir),
        SEQ,
        4,
        shuffle=False,
        repeat=False,
        data_format="chat",
        chat_template=ChatTemplate.from_dir(tok_dir),
        chat_overflow=overflow,
        notes=notes,
    )
    keys = ("tokens", "segment_ids", "positions", "loss_mask")
    return [tuple(b[k][r] for k in keys) for b in batches for r in range(len(b["tokens"]))]


def _segments(rows):
    """Each packed document: (tokens, positions, mask)."""
    out = []
    for tokens, seg, pos, mask in rows:
        for s in range(1, int(seg.max()) + 1):
            at = seg == s
            out.append((tokens[at], pos[at], mask[at]))
    return out


def _encoded(record, tok_dir):
    return encode_record(record, make_tokenizer(tok_dir), ChatTemplate.from_dir(tok_dir))


@pytest.fixture(scope="module")
def mixed(tok_dir, tmp_path_factory):
    """Two short chats and one whose answer is far past SEQ tokens."""
    short = [_chat("Hi?", "Hello."), _chat("Capital?", "Paris.")]
    long = _chat("Tell me a story.", "Once upon a time there was a sea. " * 12)
    assert (
        len(_encoded(long, tok_dir)["tokens"])
        > SEQ
        >= max(len(_encoded(r, tok_dir)["tokens"]) for r in short)
    )
    path = _write(tmp_path_factory.mktemp("chats") / "mixed.jsonl", [short[0], long, short[1]])
    return path, short, long


def test_drop_leaves_long_conversations_out_and_counts_them(mixed, tok_dir):
    path, short, _ = mixed
    notes = []
    segments = _segments(_rows(path, tok_dir, "drop", notes))
    want = [_encoded(r, tok_dir) for r in short]
    assert len(segments) == 2  # the long one is not there, in pieces or whole
    for (tokens, pos, mask), w in zip(segments, want, strict=True):
        np.testing.assert_array_equal(tokens, w["tokens"])
        np.testing.assert_array_equal(mask, w["loss_mask"])
        np.testing.assert_array_equal(pos, np.arange(len(tokens)))
    assert len(notes) == 1
    assert f"dropped 1 of 3 conversations longer than data.seq_len={SEQ}" in notes[0]
    assert path in notes[0]


def test_truncate_left_keeps_the_end_of_a_long_conversation(mixed, tok_dir):
    path, _, long = mixed
    notes = []
    segments = _segments(_rows(path, tok_dir, "truncate_left", notes))
    assert len(segments) == 3  # never split: one segment per conversation
    whole = _encoded(long, tok_dir)
    tokens, pos, mask = next(s for s in segments if len(s[0]) == SEQ)  # packing reorders
    np.testing.assert_array_equal(tokens, whole["tokens"][-SEQ:])
    np.testing.assert_array_equal(mask, whole["loss_mask"][-SEQ:])
    np.testing.assert_array_equal(pos, np.arange(SEQ))
    assert f"kept the last {SEQ} tokens of 1 of 3 conversations" in notes[0]


def test_error_names_the_record_and_its_length(mixed, tok_dir):
    path, _, long = mixed
    n = len(_encoded(long, tok_dir)["tokens"])
    with pytest.raises(ValueError) as e:
        _rows(path, tok_dir, "error")
    assert str(e.value).startswith(f"{path} record 2: {n} tokens, more than data.seq_len={SEQ}")
    assert "data.chat_overflow=drop" in str(e.value)


def test_a_chat_source_with_no_assistant_turn_exits_2(tok_dir, tmp_path):
    """Through train_main: one line naming the file and the count, before any compile."""
    path = _write(tmp_path / "questions.jsonl", [_chat(f"Question {i}?", None) for i in range(5)])
    flags = {**SMALL_RUN, "model.vocab_size": 384, "data.format": "chat"}
    flags |= {"data.tokenizer": tok_dir, "data.source": path, "training.steps": 2}
    flags["optimizer.warmup_steps"] = 0
    result = _entry.train([f"--workdir={tmp_path / 'run'}", *cli_flags(flags)])
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr[-3000:]
    assert len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith(f"error: data.source={path!r} (train split): nothing to train on")
    assert re.search(
        r"of its (\d) conversations, \1 hold no trained token \(no assistant turn", lines[0]
    )


def test_unknown_overflow_policy_is_one_line():
    from nnx_zoo.training.config import RunConfig

    with pytest.raises(ValueError, match=r"data.chat_overflow='split'.*valid: drop, truncate_left"):
        RunConfig.from_config_dict({"data": {"chat_overflow": "split"}})
