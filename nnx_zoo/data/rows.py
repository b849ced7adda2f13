"""Rows of a pre-tokenized store (nnx_zoo/data/token_store.py), each process reading only its own.

The stream: the split's documents in store order, each followed by EOS, cut into rows of
seq_len tokens (concat-then-split). Row i is tokens [i*T, (i+1)*T) of that stream, so it is
placed by a binary search over the documents' cumulative lengths (from the shards' lengths
files, never the records) and built from the records it overlaps alone: the rows form a
random-access `grain.MapDataset` (`store_rows`). Every row is full (padding 0%; training drops
the stream's last partial row, a single evaluation pass pads it); a document that crosses a
row boundary is split there, where the first-fit packer (the document pipeline) would have
moved it whole to a row with room and split only documents longer than a row.

A row's `segment_ids` are 1, 2, ... per document piece in it; `positions` restart at 0 in each
piece, as the document pipeline's chunker does: positions stay below seq_len (inside any
position table or RoPE scaling range the model was built for), and attention within a segment
sees only relative positions, so continuing a document's offsets would change nothing else.

Order: a global permutation of the row numbers (grain's index shuffle, reseeded each epoch
when repeating). Global batch b is rows b*B .. (b+1)*B-1 of the permuted stream, and process p
of n reads only rows [p*B/n, (p+1)*B/n) of it (`store_batches`): the global batches, and so the
losses, are those of one process, while each process reads 1/n of the records. The
iterator's state is the batch index, `{"batch_index": b}`: one global fact on every process
count and worker count, so a run resumes on another (4 processes -> 2, 0 workers -> 2).

Split: each document is in train or validation by the hash of its number in the store (the
one ArrayRecord sources use), so the two never share a document; each split is its own stream.

Memory and reads per process: every shard's lengths file (4 bytes per document) and, for each
shard it reads from, the shard's chunk index (a few bytes per document), then only its rows'
records. A document is one record: a row that holds part of a long document reads all of it.
"""

from __future__ import annotations

import math
import sys

import grain
import numpy as np

from nnx_zoo.data import position, sources
from nnx_zoo.data.token_store import TokenStore
from nnx_zoo.errors import UsageError
from nnx_zoo.runtime import absl_flags

KEYS = ("tokens", "segment_ids", "positions")
BATCH_INDEX = "batch_index"


class RowLayout:
    """Where each row of a split's stream lies: the kept documents' numbers and the end of
    each in the stream (its tokens and EOS counted)."""

    def __init__(self, store: TokenStore, split: str, seq_len: int, validation_fraction: float):
        if split not in sources.SPLITS:
            raise UsageError(f"unknown split {split!r}; expected one of {sources.SPLITS}")
        self.store, self.seq_len = store, seq_len
        self.eos_id = int(store.index["tokenizer"]["eos_id"])
        number = np.arange(len(store), dtype=np.int64)
        in_val = sources._both_sides(sources._index_in_validation(number, validation_fraction))
        self.documents = number[sources._keep(in_val, split)]
        if not len(self.documents):
            raise UsageError(
                sources._no_documents(store.path, split, len(store), validation_fraction)
            )
        self.ends = np.cumsum(store.lengths[self.documents] + 1)
        self.total_tokens = int(self.ends[-1])

    def num_rows(self, pad_last: bool) -> int:
        rows = self.total_tokens / self.seq_len
        return math.ceil(rows) if pad_last else int(rows)

    def pieces(self, row: int) -> list[tuple[int, int, int]]:
        """(kept document k, first token, end token) of each piece in `row`; token offsets
        within the document, EOS at offset len."""
        start = row * self.seq_len
        end = min(start + self.seq_len, self.total_tokens)
        first = int(np.searchsorted(self.ends, start, side="right"))
        last = int(np.searchsorted(self.ends, end - 1, side="right"))
        out = []
        for k in range(first, last + 1):
            doc_start = int(self.ends[k]) - int(self.store.lengths[self.documents[k]]) - 1
            out.append((k, max(start - doc_start, 0), min(end, int(self.ends[k])) - doc_start))
        return out

    def split_fraction(self) -> float:
        """Share of documents whose tokens (EOS included) lie in more than one row."""
        starts = self.ends - self.store.lengths[self.documents] - 1
        return float(np.mean(starts // self.seq_len != (self.ends - 1) // self.seq_len))


class _ReadRow:
    """Row number -> {tokens, segment_ids, positions} int32 [T]; a class so it pickles."""

    def __init__(self, layout: RowLayout):
        self.layout = layout

    def __call__(self, row: int) -> dict[str, np.ndarray]:
        layout = self.layout
        pieces = layout.pieces(int(row))
        records = layout.store.read([layout.documents[k] for k, _, _ in pieces])
        tokens, segments, positions = [], [], []
        for s, ((_, lo, hi), (ids, _)) in enumerate(zip(pieces, records, strict=True), 1):
            piece = ids[lo : min(hi, len(ids))]
            if hi > len(ids):  # the piece ends with the document: its EOS
                piece = np.append(piece, np.int32(layout.eos_id))
            tokens.append(piece)
            segments.append(np.full(len(piece), s, np.int32))
            positions.append(np.arange(len(piece), dtype=np.int32))
        pad = layout.seq_len - sum(len(t) for t in tokens)
        zeros = [np.zeros(pad, np.int32)]
        return {
            "tokens": np.concatenate(tokens + zeros).astype(np.int32),
            "segment_ids": np.concatenate(segments + zeros),
            "positions": np.concatenate(positions + zeros),
        }


def store_rows(
    source: str | TokenStore,
    split: str,
    seq_len: int,
    *,
    seed: int = 0,
    shuffle: bool = True,
    repeat: bool = True,
    validation_fraction: float = sources.DEFAULT_VALIDATION_FRACTION,
) -> grain.MapDataset:
    """The global row stream of a text store's `split`: a MapDataset of dicts of int32 [T]
    arrays (`tokens`, `segment_ids`, `positions`), permuted by `seed` when `shuffle` (and
    reshuffled each epoch when `repeat`, then infinite). Row i is read directly, so a mixture
    may `grain.MapDataset.mix` it with others before batching. Without `repeat` the last row
    is padded; with it, the last partial row is dropped."""
    store = source if isinstance(source, TokenStore) else TokenStore(source)
    layout = RowLayout(store, split, seq_len, validation_fraction)
    rows = grain.MapDataset.range(layout.num_rows(pad_last=not repeat))
    if not len(rows):
        raise UsageError(
            f"data.source={store.path!r} ({split} split) holds {layout.total_tokens} tokens, "
            f"less than one row of data.seq_len={seq_len}"
        )
    if shuffle:
        rows = rows.shuffle(seed=seed)
    if repeat:
        rows = rows.repeat(None)  # reseeds the permutation every epoch
    return rows.map(_ReadRow(layout))


class _LocalBatch:
    """Global batch number -> this process's rows of it, [B/n, T] each key; rows past the end
    of a single pass are padding (segment 0)."""

    def __init__(self, rows: grain.MapDataset, batch_size: int, index: int, count: int, seq_len):
        self.rows, self.batch_size, self.seq_len = rows, batch_size, seq_len
        self.local = batch_size // count
        self.offset = index * self.local

    def __call__(self, batch: int) -> dict[str, np.ndarray]:
        first = int(batch) * self.batch_size + self.offset
        padding = {k: np.zeros(self.seq_len, np.int32) for k in KEYS}
        rows = [
            self.rows[i] if i < len(self.rows) else padding
            for i in range(first, first + self.local)
        ]
        return {k: np.stack([r[k] for r in rows]) for k in KEYS}


class _BatchIndexIterator(grain.DatasetIterator):
    """The batches; its state is `{"batch_index": b}` whatever the worker count."""

    def __init__(self, parent, num_workers: int):
        super().__init__(parent)
        self._num_workers = num_workers

    def __next__(self):
        return next(self._parent)

    def get_state(self) -> dict:
        return {BATCH_INDEX: position.reader_documents(self._parent.get_state())}

    def set_state(self, state: dict) -> None:
        if set(state) != {BATCH_INDEX}:
            raise UsageError(
                f"data-iterator state {sorted(state)} is not a token store's position "
                f"({{{BATCH_INDEX!r}: n}}); it was written by another data pipeline"
            )
        batches = int(state[BATCH_INDEX])
        self._parent.set_state(position.reader_state(batches, self._num_workers))


class _BatchIndex(grain.IterDataset):
    def __init__(self, parent, num_workers: int):
        super().__init__(parent)
        self._num_workers = num_workers

    def __iter__(self) -> _BatchIndexIterator:
        return _BatchIndexIterator(self._parent.__iter__(), self._num_workers)


def store_batches(
    source: str | TokenStore,
    split: str,
    seq_len: int,
    global_batch_size: int,
    *,
    process_index: int,
    process_count: int,
    seed: int = 0,
    shuffle: bool = True,
    repeat: bool = True,
    num_batches: int | None = None,
    num_workers: int = 0,
    validation_fraction: float = sources.DEFAULT_VALIDATION_FRACTION,
) -> grain.IterDataset:
    """This process's rows of each global batch of `store_rows`, [B/n, T] per key. Without
    `repeat`: one pass, the last batch padded, then (given `num_batches`) all-padding batches
    up to exactly `num_batches`, so every process runs the same evaluation steps."""
    rows = store_rows(
        source,
        split,
        seq_len,
        seed=seed,
        shuffle=shuffle,
        repeat=repeat,
        validation_fraction=validation_fraction,
    )
    if repeat:
        count = len(rows) // global_batch_size if num_batches is None else num_batches
    else:
        count = num_batches if num_batches is not None else -(-len(rows) // global_batch_size)
    count = min(count, sys.maxsize)
    local = _LocalBatch(rows, global_batch_size, process_index, process_count, seq_len)
    batches = grain.MapDataset.range(count).map(local)
    # A few threads read ahead; rows are records read, not text tokenized, so threads do.
    ds = batches.to_iter_dataset(grain.ReadOptions(num_threads=4, prefetch_buffer_size=4))
    if num_workers > 0:
        absl_flags.mark_parsed()  # Grain reads absl flags as it starts the workers
        ds = batches.to_iter_dataset().mp_prefetch(
            grain.MultiprocessingOptions(num_workers=num_workers)
        )
    return _BatchIndex(ds, num_workers)
