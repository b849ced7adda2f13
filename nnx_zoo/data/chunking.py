"""Documents -> chunks of at most seq_len tokens, in memory bounded per document.

A text longer than `LONG_TEXT_CHARS` characters is not tokenized whole where the pipeline reads
(Grain's read threads, or worker processes, which hold up to hundreds of documents ahead):
it passes on as text, and the chunker tokenizes it here, one piece of at most `PIECE_CHARS`
characters at a time, carrying the tokens that do not fill a chunk into the next piece. So a
document's tokens never exist whole: what one document costs beyond its text is a piece's
ids and the chunks the later stages keep (the shuffle window, the packer), whatever the
length of the line. Shorter texts, token arrays (ArrayRecord) and chat records arrive
tokenized and are sliced into chunks as they are needed, never listed all at once.

A piece ends just before a whitespace character (searched for in its last quarter), so a
word is never cut: the ids are those of the whole text for the byte tokenizer and for
tokenizers whose pre-tokenizer splits at whitespace (byte-level BPE, WordPiece); a
tokenizer that merges across a space may differ at a cut (one per `PIECE_CHARS`).

The chunker's state has the layout of Grain's flat map, which nnx_zoo/data/position.py reads:
the state of the stage before it when the current document was read (`parent`), and how many
chunks of that document have been handed on (`next_index_in_buffer`). A restore reads that
document again and skips that many chunks.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grain
import numpy as np

# Texts longer than this are tokenized by the chunker, in pieces (module docstring).
LONG_TEXT_CHARS = 1 << 16
PIECE_CHARS = 1 << 16


def is_long_text(doc) -> bool:
    return isinstance(doc, str) and len(doc) > LONG_TEXT_CHARS


def _pieces(text: str) -> Iterator[str]:
    """`text` in consecutive pieces of at most PIECE_CHARS characters, each ending before a
    whitespace character where its last quarter has one."""
    start, n = 0, len(text)
    while n - start > PIECE_CHARS:
        end = start + PIECE_CHARS
        floor = end - PIECE_CHARS // 4
        cut = end
        while cut > floor and not text[cut].isspace():
            cut -= 1
        end = cut if cut > floor else end
        yield text[start:end]
        start = end
    yield text[start:]


def _encode(tokenizer, text: str) -> np.ndarray:
    encode_np = getattr(tokenizer, "encode_np", None)
    ids = encode_np(text) if encode_np else tokenizer.encode(text)
    return np.asarray(ids, dtype=np.int32)


def _text_chunks(text: str, seq_len: int, tokenizer) -> Iterator[dict[str, np.ndarray]]:
    """The chunks of `text`'s ids + EOS, tokenized piece by piece."""
    carry = np.zeros(0, np.int32)
    for piece in _pieces(text):
        ids = np.concatenate([carry, _encode(tokenizer, piece)])
        full = len(ids) // seq_len * seq_len
        for i in range(0, full, seq_len):
            yield {"tokens": ids[i : i + seq_len]}
        carry = ids[full:].copy()  # not a view: the piece's ids can go
    last = np.append(carry, np.int32(tokenizer.eos_id))
    for i in range(0, len(last), seq_len):
        yield {"tokens": last[i : i + seq_len]}


def chunks(doc, seq_len: int, tokenizer) -> Iterator[dict[str, np.ndarray]]:
    """A document's chunks of at most seq_len tokens, in order: a long text (tokenized here),
    ids (EOS already appended), or {'tokens', 'loss_mask'} (cut alongside)."""
    if isinstance(doc, str):
        yield from _text_chunks(doc, seq_len, tokenizer)
        return
    doc = doc if isinstance(doc, dict) else {"tokens": doc}
    for i in range(0, len(doc["tokens"]), seq_len):
        yield {k: v[i : i + seq_len] for k, v in doc.items()}


class _ChunkIterator(grain.DatasetIterator):
    def __init__(self, parent, seq_len: int, tokenizer):
        super().__init__(parent)
        self._seq_len, self._tokenizer = seq_len, tokenizer
        self._last_parent_state = self._parent.get_state()
        self._chunks: Iterator | None = None
        self._handed = 0  # chunks of the current document handed on

    def __next__(self):
        while True:
            if self._chunks is not None:
                chunk = next(self._chunks, None)
                if chunk is not None:
                    self._handed += 1
                    return chunk
            self._last_parent_state = self._parent.get_state()
            doc = next(self._parent)  # StopIteration: the documents ran out
            self._chunks = chunks(doc, self._seq_len, self._tokenizer)
            self._handed = 0

    def get_state(self) -> dict[str, Any]:
        return {"parent": self._last_parent_state, "next_index_in_buffer": self._handed}

    def set_state(self, state: dict[str, Any]) -> None:
        self._last_parent_state = state["parent"]
        self._parent.set_state(state["parent"])
        self._chunks, self._handed = None, 0
        try:
            doc = next(self._parent)
        except StopIteration:  # a position at the end stays there
            return
        self._chunks = chunks(doc, self._seq_len, self._tokenizer)
        for _ in range(state["next_index_in_buffer"]):
            next(self._chunks)
        self._handed = state["next_index_in_buffer"]


class ChunkDocuments(grain.IterDataset):
    """`parent`'s documents as chunks of at most `seq_len` tokens (module docstring)."""

    def __init__(self, parent, seq_len: int, tokenizer):
        super().__init__(parent)
        self._seq_len, self._tokenizer = seq_len, tokenizer

    def __iter__(self) -> _ChunkIterator:
        return _ChunkIterator(self._parent.__iter__(), self._seq_len, self._tokenizer)
