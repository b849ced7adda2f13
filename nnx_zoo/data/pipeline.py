"""Training and validation batches on Grain: documents -> token ids -> packed rows -> batches.

Documents come from nnx_zoo/data/sources.py (the `source` string, the train/validation split).

Pipeline, in this order and why:
  shuffle/repeat  seeded, reshuffled each epoch; training repeats forever, evaluation makes one
                  pass in file order.
  tokenize        text -> ids + EOS (in Grain's read threads); a text longer than
                  chunking.LONG_TEXT_CHARS passes on as text.
  mp_prefetch     optional worker processes. Placed before anything stateful so the output does
                  not depend on the number of workers (after packing, it would).
  chunk           documents longer than seq_len become several documents of <= seq_len tokens,
                  one at a time; a long text is tokenized here, piece by piece, so memory does
                  not grow with the length of one document (nnx_zoo/data/chunking.py).
  window shuffle  (when shuffling) mixes the chunks of `shuffle_window` consecutive chunks, so
                  one long file does not fill a whole batch with its consecutive pieces.
  pack            grain FirstFitPackIterDataset into rows of seq_len.
  batch           [global_batch_size, seq_len]: the global batch.
  process rows    process p keeps rows [p*B/n, (p+1)*B/n) of it (n processes, B rows).

One stream for every process count. Every process runs the whole pipeline above over all the
documents and keeps its rows of each global batch, so the global batches, and so the losses,
are those of a one-process run whatever the number of processes, and the stream's position is
one global fact (nnx_zoo/data/position.py) that resumes on any process count and worker count.
Splitting the documents by process instead (as earlier versions did) ties the batches to the
process count: a run's trajectory would depend on how many hosts it ran on, and its position
could not move to another count.

The cost: each process reads, tokenizes and packs every document, n times the work of reading
1/n of them, so every process must build the stream as fast as the whole run consumes it (its
tokens_per_second). One process's rate against what runs consume is docs/data.md's table
"One process's stream" (bench/data_throughput.py); past it, `num_workers` spreads tokenizing
over a host's cores, and a pre-tokenized store (`zoo-data`, nnx_zoo/data/token_store.py)
takes tokenizing out of the run.

A text store as `source` takes another path (nnx_zoo/data/rows.py): concat-then-split rows read
directly by number, each process reading only the rows of its share of each global batch; the
batches have the same keys and the same independence of process and worker count, and the
state is the batch index. A chat / prompt_completion store takes the pipeline below (its
records are whole conversations, packed, never split). `data_wait_time` in
metrics.jsonl shows when the stream falls behind.

Each batch is a dict of int32 arrays [B, T]: `tokens`, `segment_ids` (1, 2, ... per document in
the row, 0 = padding) and `positions` (0, 1, ... restarting in each document; 0 on padding).
The iterator's `get_state()` is a JSON-able dict, the same on every process and for every
`num_workers` (nnx_zoo/data/position.py), and `set_state()` resumes exactly, into an iterator built
with the same arguments apart from `process_index`, `process_count` and `num_workers`.
"""

from __future__ import annotations

from typing import Any

import grain
import jax
import numpy as np

from nnx_zoo.data import token_store
from nnx_zoo.data.chunking import ChunkDocuments, is_long_text
from nnx_zoo.data.position import GlobalPosition
from nnx_zoo.data.rows import store_batches
from nnx_zoo.data.sources import DEFAULT_VALIDATION_FRACTION, load_documents
from nnx_zoo.data.tokenizers import Tokenizer
from nnx_zoo.errors import UsageError
from nnx_zoo.runtime import absl_flags

# ----------------------------------------------------------------------------- pipeline


class _Tokenize:
    """Document (text or ids) -> int32 ids with EOS appended."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, doc: str | np.ndarray) -> np.ndarray | str:
        tok = self.tokenizer
        if is_long_text(doc):  # the chunker tokenizes it in pieces (data/chunking.py)
            return doc
        if isinstance(doc, str):
            if not doc:  # an empty text (a streamed source reads it so): no document
                return np.zeros(0, np.int32)
            encode_np = getattr(tok, "encode_np", None)
            ids = encode_np(doc) if encode_np else np.asarray(tok.encode(doc), dtype=np.int32)
        else:
            ids = doc
            if ids.size and (ids.min() < 0 or ids.max() >= tok.vocab_size):
                raise UsageError(
                    f"token id {int(ids.max())} outside the tokenizer's vocabulary "
                    f"[0, {tok.vocab_size}); was the ArrayRecord written with another tokenizer?"
                )
        return np.append(ids, np.int32(tok.eos_id)).astype(np.int32)


def _as_is(doc):
    return doc


def _copy(doc):
    if isinstance(doc, str):
        return doc
    return {k: np.array(v) for k, v in doc.items()} if isinstance(doc, dict) else np.array(doc)


def _rename_packed(row: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = {
        "tokens": row["tokens"].astype(np.int32),
        "segment_ids": row["tokens_segment_ids"].astype(np.int32),
        "positions": row["tokens_positions"].astype(np.int32),
    }
    if "loss_mask" in row:  # chat / instruction data: which tokens are trained targets
        out["loss_mask"] = row["loss_mask"].astype(np.int32)
    return out


class _ProcessRows:
    """Global batch [B, ...] -> this process's rows [p*B/n, (p+1)*B/n)."""

    def __init__(self, process_index: int, process_count: int):
        self.index, self.count = process_index, process_count

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.count == 1:
            return batch
        rows = batch["tokens"].shape[0] // self.count
        start = self.index * rows
        return {k: v[start : start + rows] for k, v in batch.items()}


class _FixedBatchesIterator(grain.DatasetIterator):
    """Pads a short last batch with padding rows (segment 0) and, given num_batches, yields
    exactly that many batches (all-padding ones after the data runs out), so every process
    runs the same number of evaluation steps."""

    def __init__(self, parent, batch_size: int, seq_len: int, num_batches: int | None, keys):
        super().__init__(parent)
        self._batch_size, self._seq_len, self._num_batches = batch_size, seq_len, num_batches
        self._keys = keys
        self._emitted = 0

    def _padding(self, rows: int) -> dict[str, np.ndarray]:
        return {k: np.zeros((rows, self._seq_len), dtype=np.int32) for k in self._keys}

    def __next__(self) -> dict[str, np.ndarray]:
        if self._num_batches is not None and self._emitted >= self._num_batches:
            raise StopIteration
        try:
            batch = next(self._parent)
        except StopIteration:
            if self._num_batches is None:
                raise
            batch = self._padding(self._batch_size)
        short = self._batch_size - batch["tokens"].shape[0]
        if short:
            pad = self._padding(short)
            batch = {k: np.concatenate([v, pad[k]]) for k, v in batch.items()}
        self._emitted += 1
        return batch

    def get_state(self) -> dict[str, Any]:
        return {"parent": self._parent.get_state(), "emitted": self._emitted}

    def set_state(self, state: dict[str, Any]) -> None:
        self._parent.set_state(state["parent"])
        self._emitted = state["emitted"]


class _FixedBatches(grain.IterDataset):
    def __init__(self, parent, batch_size: int, seq_len: int, num_batches: int | None, keys):
        super().__init__(parent)
        self._args = (batch_size, seq_len, num_batches, keys)

    def __iter__(self) -> _FixedBatchesIterator:
        return _FixedBatchesIterator(self._parent.__iter__(), *self._args)


def check_batch_split(global_batch_size: int, process_count: int) -> None:
    if global_batch_size % process_count:
        raise UsageError(
            f"global_batch_size={global_batch_size} is not divisible by the "
            f"{process_count} processes"
        )


def check_store(source: str, tokenizer: Tokenizer, data_format: str) -> None:
    """UsageError (one line) unless the token store at `source` was written with `tokenizer`
    in `data_format`."""
    index = token_store.read_index(source)
    token_store.check_tokenizer(source, index, tokenizer)
    if index["data_format"] != data_format:
        raise UsageError(
            f"data.source={source!r} holds {index['data_format']} data (zoo-data "
            f"--format={index['data_format']}); set --config.data.format="
            f"{index['data_format']}"
        )


def packed_rows(
    source: str,
    split: str,
    tokenizer: Tokenizer,
    seq_len: int,
    seed: int,
    *,
    num_workers: int,
    shuffle: bool,
    repeat: bool,
    num_packing_bins: int,
    text_field: str = "text",
    validation_fraction: float = DEFAULT_VALIDATION_FRACTION,
    shuffle_window: int = 1024,
    data_format: str = "text",
    chat_template=None,
    chat_overflow: str = "drop",
    notes: list[str] | None = None,
) -> tuple[grain.IterDataset, tuple[str, ...]]:
    """The packed rows of `source`/`split`, one at a time (the pipeline of the module
    docstring up to packing): an IterDataset of dicts of int32 [seq_len] arrays, and their
    keys. `build_dataset` batches them; a mixture (nnx_zoo/data/mixture.py) mixes several.
    Its iterator's state converts to the global form with nnx_zoo/data/position.py."""
    if data_format == "text":
        docs = load_documents(
            source, split, text_field=text_field, validation_fraction=validation_fraction
        )
        encode, keys = _Tokenize(tokenizer), ("tokens", "segment_ids", "positions")
    elif data_format == "preference":
        from nnx_zoo.data import preference

        docs = preference.encode_records(
            source,
            split,
            validation_fraction,
            tokenizer,
            chat_template,
            seq_len=seq_len,
            overflow=chat_overflow,
            notes=notes,
        )
        encode = _as_is  # each pair fits a row: chosen and rejected are never apart
        keys = ("tokens", "segment_ids", "positions", "loss_mask")
    else:
        from nnx_zoo.data import chat

        docs = chat.encode_records(
            source,
            split,
            data_format,
            validation_fraction,
            tokenizer,
            chat_template,
            seq_len=seq_len,
            overflow=chat_overflow,
            notes=notes,
        )
        encode = _as_is  # encoded while building: each record fits a row, never split
        keys = ("tokens", "segment_ids", "positions", "loss_mask")
    if shuffle:
        docs = docs.shuffle(seed=seed)
    if repeat:
        docs = docs.repeat(None)  # reseeds the shuffle every epoch
    ds = docs.map(encode).to_iter_dataset()
    if num_workers > 0:
        # Grain reads absl flags as it starts the workers; outside an absl app (a bench, a
        # notebook, a plain script) they are unparsed and it would raise.
        absl_flags.mark_parsed()
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=num_workers))
        # Worker outputs arrive in shared memory, freed when the array is dropped; the shuffle
        # window and the packer keep chunks (views) for many steps, and at exit they would
        # still hold it. A copy lets each segment go at once.
        ds = ds.map(_copy)
    ds = ChunkDocuments(ds, seq_len, tokenizer)
    if shuffle and shuffle_window > 1:
        ds = grain.experimental.WindowShuffleIterDataset(ds, window_size=shuffle_window, seed=seed)
    packed = ("tokens", "loss_mask")[: len(keys) - 2]
    rows = _rename_packed
    if data_format == "preference":  # a pair packs as one document, split after packing
        packed, rows = (*packed, "side"), preference.split_pair_segments
    ds = grain.experimental.FirstFitPackIterDataset(
        ds,
        length_struct={k: seq_len for k in packed},
        num_packing_bins=num_packing_bins,
        seed=seed,
        shuffle_bins=shuffle,
    )
    return ds.map(rows), keys


def build_dataset(
    source: str,
    split: str,
    tokenizer: Tokenizer,
    seq_len: int,
    global_batch_size: int,
    seed: int = 0,
    *,
    process_index: int | None = None,
    process_count: int | None = None,
    num_workers: int = 0,
    shuffle: bool | None = None,
    repeat: bool | None = None,
    num_batches: int | None = None,
    text_field: str = "text",
    validation_fraction: float = DEFAULT_VALIDATION_FRACTION,
    num_packing_bins: int | None = None,
    shuffle_window: int = 1024,
    data_format: str = "text",
    chat_template=None,
    chat_overflow: str = "drop",
    notes: list[str] | None = None,
) -> grain.IterDataset:
    """The batches of `source`/`split` for this process, as a Grain IterDataset.

    Args:
      source: 'default' or a path/directory/glob (module docstring).
      split: 'train', 'validation' or 'all'.
      tokenizer: from `data.tokenizers.make_tokenizer`.
      seq_len: T, the length of each packed row.
      global_batch_size: B, rows per step over all processes; process p gets rows
        [p*B/n, (p+1)*B/n) of each global batch (n processes).
      seed: seeds the document shuffle (reshuffled every epoch) and the order of packed rows.
      process_index, process_count: which rows of each global batch this process keeps;
        default jax.process_index() and jax.process_count(). They change neither the global
        batches nor the iterator's state.
      num_workers: worker processes for reading and tokenizing (0 = in this process); from
        any entry point, absl app or not. Changes neither the batches nor the state.
      shuffle: default True for 'train', False otherwise.
      repeat: repeat forever; default True for 'train'. Otherwise one pass, the last batch padded.
      num_batches: yield exactly this many batches; without repeat, all-padding batches follow
        when the data runs out, so all processes agree on the number of evaluation steps.
      text_field: the JSONL field / Parquet column holding the text.
      validation_fraction: share of documents in 'validation'.
      num_packing_bins: rows packed at once; default max(global_batch_size, 16). More bins
        pack tighter.
      shuffle_window: chunks shuffled together after chunking (when shuffling). Memory is
        about shuffle_window * seq_len * 4 bytes; a restore replays at most one window.
      data_format: 'text' (documents), 'chat' or 'prompt_completion' (records,
        nnx_zoo/data/chat.py):
        then batches also carry `loss_mask` [B, T], 1 where the token is a trained target
        (assistant turns, completions), packed and chunked with its tokens.
      chat_template: a data.chat.ChatTemplate, for chat records.
      chat_overflow: what a record longer than seq_len becomes: 'drop' | 'truncate_left' |
        'error' (data.chat.encode_records); records are never split into rows.
      notes: where to append the one-line count of records dropped or cut.

    `iter(dataset)` gives a grain DatasetIterator of dicts of int32 arrays [B, T] (`tokens`,
    `segment_ids`, `positions`) with JSON-able `get_state()` / `set_state()`; `make_dataset`
    returns that iterator directly.
    """
    process_index = jax.process_index() if process_index is None else process_index
    process_count = jax.process_count() if process_count is None else process_count
    check_batch_split(global_batch_size, process_count)
    shuffle = split == "train" if shuffle is None else shuffle
    repeat = split == "train" if repeat is None else repeat

    if token_store.is_store(source):
        check_store(source, tokenizer, data_format)
        if data_format == "text":  # rows read directly, each process its own (data/rows.py)
            return store_batches(
                source,
                split,
                seq_len,
                global_batch_size,
                process_index=process_index,
                process_count=process_count,
                seed=seed,
                shuffle=shuffle,
                repeat=repeat,
                num_batches=num_batches,
                num_workers=num_workers,
                validation_fraction=validation_fraction,
            )
        # chat records: never split into rows, so they take the document pipeline below

    ds, keys = packed_rows(
        source,
        split,
        tokenizer,
        seq_len,
        seed,
        num_workers=num_workers,
        shuffle=shuffle,
        repeat=repeat,
        text_field=text_field,
        validation_fraction=validation_fraction,
        num_packing_bins=num_packing_bins or max(global_batch_size, 16),
        shuffle_window=shuffle_window,
        data_format=data_format,
        chat_template=chat_template,
        chat_overflow=chat_overflow,
        notes=notes,
    )
    ds = ds.batch(global_batch_size, drop_remainder=repeat)
    if not repeat:
        ds = _FixedBatches(ds, global_batch_size, seq_len, num_batches, keys)
    elif num_batches is not None:
        ds = grain.experimental.LimitIterDataset(ds, num_batches)
    ds = ds.map(_ProcessRows(process_index, process_count))
    return GlobalPosition(ds, num_workers)


def make_dataset(*args, **kwargs) -> grain.DatasetIterator:
    """`iter(build_dataset(...))`: the iterator to train or evaluate on, and to checkpoint
    (`get_state()` / `set_state()`, or grain.checkpoint.CheckpointSave/Restore with Orbax).
    Takes exactly the arguments of `build_dataset`."""
    return iter(build_dataset(*args, **kwargs))
