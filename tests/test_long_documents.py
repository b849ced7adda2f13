"""One very long document costs bounded memory (issue 40, item 3): reading, tokenizing and
chunking stream it in pieces (nnx_zoo/data/chunking.py), and the chunks are those of the
whole document's ids.

On 9d09506 a 5 MB single-line document took 1.9 GB of host memory for the first batch (a
3-step run: 11 GB): Grain's read threads held up to 500 whole tokenized copies of it (the
source repeats), and the chunker listed every chunk of it at once.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import grain
import numpy as np
import pytest
from _train_helpers import ROOT, child_env
from chat_fixtures import write_tokenizer_dir

from nnx_zoo.data.chunking import LONG_TEXT_CHARS, PIECE_CHARS, ChunkDocuments
from nnx_zoo.data.tokenizers import ByteTokenizer, make_tokenizer

SEQ = 64
# Words of several lengths, one space apart, and non-ASCII: pieces cut between characters.
WORDS = ["alpha", "beta", "gamma", "δέλτα", "epsilon", "日本語", "z"]


def _text(chars: int, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    words = rng.choice(WORDS, size=chars // 4)
    return " ".join(words)[:chars]


def _chunked(text: str, tokenizer, state=None, skip: int = 0):
    ds = ChunkDocuments(grain.MapDataset.source([text]).to_iter_dataset(), SEQ, tokenizer)
    it = iter(ds)
    if state is not None:
        it.set_state(state)
    out = [next(it)["tokens"] for _ in range(skip)]
    return it, out


@pytest.mark.parametrize("kind", ["byte", "bpe"])
def test_long_text_chunks_equal_the_whole_documents(kind, tmp_path):
    """A text of 3.5 pieces, tokenized in pieces, gives the chunks of its whole ids + EOS;
    a position saved inside it resumes at the same chunk."""
    tokenizer = ByteTokenizer() if kind == "byte" else _bpe(tmp_path)
    text = _text(int(3.5 * PIECE_CHARS))
    assert len(text) > LONG_TEXT_CHARS
    ids = np.append(np.asarray(tokenizer.encode(text), np.int32), tokenizer.eos_id)
    want = [ids[i : i + SEQ] for i in range(0, len(ids), SEQ)]
    it, got = _chunked(text, tokenizer)
    got += [c["tokens"] for c in it]
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    # Resume halfway through (inside the second piece).
    half = len(want) // 2
    it, _ = _chunked(text, tokenizer, skip=half)
    state = it.get_state()
    assert state["next_index_in_buffer"] == half
    resumed, rest = _chunked(text, tokenizer, state=state, skip=3)
    for g, w in zip(rest, want[half : half + 3], strict=True):
        np.testing.assert_array_equal(g, w)


def _bpe(tmp_path):
    """A byte-level BPE tokenizer.json (GPT-2's pre-tokenizer: words with their leading space)."""
    return make_tokenizer(write_tokenizer_dir(str(tmp_path / "bpe"), "llama3"))


# The child process: the cap, then the first batch of a run's training stream over one
# 50 MB single-line document (a 1-line .txt: one paragraph), as train_main builds it.
_CHILD = textwrap.dedent(
    """
    import resource, sys
    from nnx_zoo.data.pipeline import make_dataset
    from nnx_zoo.data.tokenizers import make_tokenizer

    def data_bytes():
        with open("/proc/self/status") as f:
            line = next(l for l in f if l.startswith("VmData:"))
        return int(line.split()[1]) * 1024

    # Everything imported and the read threads' stacks aside, BUDGET more bytes.
    budget = int(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_DATA, (data_bytes() + budget, resource.RLIM_INFINITY))
    it = make_dataset(sys.argv[1], "train", make_tokenizer("byte"), 64, 16,
                      process_index=0, process_count=1)
    batch = next(it)
    print("first batch", batch["tokens"].shape, int((batch["segment_ids"] > 0).sum()))
    """
)
BUDGET = 768 * 2**20  # 50 MB of text, read and decoded, and Grain's 16 read threads' stacks


def test_first_batch_of_a_50mb_line_under_a_memory_cap(tmp_path):
    path = tmp_path / "one_line.txt"
    block = _text(2**20) + " "
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(50):
            f.write(block)
        f.write("\n")
    result = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path), str(BUDGET)],
        env=child_env(1),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "first batch (16, 64) 1024" in result.stdout, result.stdout
    assert os.path.getsize(path) > 50 * 2**20
