"""Training and validation batches on Grain: documents -> token ids -> packed rows -> batches.

Sources (the `source` string):
  'default'   real text that every Python carries and needs no download: the `.py` files of the
              running interpreter's standard library (test folders and site-packages left out),
              in sorted order, capped at `DEFAULT_MAX_BYTES`. One file = one document. The corpus
              is fixed for a given Python version.
  a path, a directory or a glob (`~` and `**` allowed), of files ending in
    .txt      one document per paragraph: runs of text separated by a blank line.
    .jsonl    one document per line, the string in field `text_field` (default 'text').
    .parquet  one document per row, the string in column `text_field` (read with pyarrow).
    .arrayrecord / .array_record
              already tokenized: one record per document, its token ids as little-endian int32
              bytes (`np.asarray(ids, '<i4').tobytes()`), without EOS. `write_token_documents`
              writes this format. Read lazily, so corpora larger than memory work; the text
              formats are read into memory.
  A path that does not exist, or a glob matching nothing, raises FileNotFoundError naming it.

Split: each document has a key (its file path relative to the stdlib, `name:index` for user
files, its record index for ArrayRecord); a hash of the key puts `validation_fraction` of the
documents in 'validation' and the rest in 'train', the same on every machine. 'all' keeps every
document (for a file that is itself held-out data).

Pipeline, in this order and why:
  process shard   documents[process_index::process_count], so processes never share documents.
  shuffle/repeat  seeded, reshuffled each epoch; training repeats forever, evaluation makes one
                  pass in file order.
  tokenize        text -> ids + EOS (in Grain's read threads).
  mp_prefetch     optional worker processes. Placed before anything stateful so the output does
                  not depend on the number of workers (after packing, it would).
  chunk           documents longer than seq_len become several documents of <= seq_len tokens.
  window shuffle  (when shuffling) mixes the chunks of `shuffle_window` consecutive chunks, so
                  one long file does not fill a whole batch with its consecutive pieces.
  pack            grain FirstFitPackIterDataset into rows of seq_len.
  batch           [global_batch_size / process_count, seq_len] per process.

Each batch is a dict of int32 arrays [B, T]: `tokens`, `segment_ids` (1, 2, ... per document in
the row, 0 = padding) and `positions` (0, 1, ... restarting in each document; 0 on padding).
The iterator's `get_state()` is a JSON-able dict and `set_state()` resumes exactly, into an
iterator built with the same arguments (num_workers included: the state of a pipeline with
worker processes has another shape).
"""

from __future__ import annotations

import glob
import json
import os
import re
import sysconfig
import zlib
from collections.abc import Iterable, Sequence
from typing import Any

import grain
import jax
import numpy as np

from training.tokenizers import Tokenizer

DEFAULT_SOURCE = "default"
DEFAULT_MAX_BYTES = 16 * 2**20  # ~12 MB of stdlib code today; reads in well under a second
DEFAULT_VALIDATION_FRACTION = 0.02
SPLITS = ("train", "validation", "all")

_TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet")
_TOKEN_SUFFIXES = (".arrayrecord", ".array_record")
# Folders of the standard library that are not its own source: test suites, installed packages.
_STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
_PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n")


# ----------------------------------------------------------------------------- documents


def stdlib_documents(max_bytes: int = DEFAULT_MAX_BYTES) -> list[tuple[str, str]]:
    """(relative path, text) of the standard library's `.py` files, sorted, up to max_bytes."""
    root = sysconfig.get_paths()["stdlib"]
    docs, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _STDLIB_SKIP_DIRS)
        for name in sorted(filenames):
            if not name.endswith(".py") or name.startswith("test_"):
                continue
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                raw = f.read()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:  # a few legacy files declare latin-1; leave them out
                continue
            if not text.strip():
                continue
            if total + len(raw) > max_bytes:
                return docs
            docs.append((os.path.relpath(path, root), text))
            total += len(raw)
    return docs


def _expand(source: str) -> list[str]:
    path = os.path.expanduser(source)
    if os.path.isdir(path):
        suffixes = _TEXT_SUFFIXES + _TOKEN_SUFFIXES
        files = glob.glob(os.path.join(path, "**", "*"), recursive=True)
        files = [p for p in files if p.endswith(suffixes) and os.path.isfile(p)]
        if not files:
            raise FileNotFoundError(f"data directory {source!r} holds no {suffixes} files")
        return sorted(files)
    if glob.has_magic(path):
        files = sorted(p for p in glob.glob(path, recursive=True) if os.path.isfile(p))
        if not files:
            raise FileNotFoundError(f"data glob {source!r} matches no files")
        return files
    if not os.path.exists(path):
        raise FileNotFoundError(f"data path {source!r} does not exist")
    return [path]


def _read_text_file(path: str, text_field: str) -> list[str]:
    if path.endswith(".txt"):
        with open(path, encoding="utf-8") as f:
            return [p.strip("\n") for p in _PARAGRAPH_BREAK.split(f.read()) if p.strip()]
    if path.endswith(".jsonl"):
        texts = []
        with open(path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                record = json.loads(line)
                if not isinstance(record.get(text_field), str):
                    raise ValueError(f"{path}:{line_no}: no string field {text_field!r}")
                texts.append(record[text_field])
        return texts
    import pyarrow.parquet as pq

    schema = pq.read_schema(path)
    if text_field not in schema.names:
        raise ValueError(f"{path}: no column {text_field!r} (columns: {schema.names})")
    return [t for t in pq.read_table(path, columns=[text_field])[text_field].to_pylist() if t]


def _in_validation(key: str, fraction: float) -> bool:
    return zlib.crc32(key.encode("utf-8")) % 10_000 < fraction * 10_000


def _index_in_validation(index: np.ndarray, fraction: float) -> np.ndarray:
    """Vectorized stand-in for _in_validation for record indices (ArrayRecord can be huge)."""
    mixed = (index.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(33)
    return mixed % np.uint64(10_000) < fraction * 10_000


def _keep(in_validation: bool | np.ndarray, split: str):
    if split == "all":
        return np.ones_like(in_validation, dtype=bool)
    return in_validation if split == "validation" else ~np.asarray(in_validation)


def load_documents(
    source: str,
    split: str,
    *,
    text_field: str = "text",
    validation_fraction: float = DEFAULT_VALIDATION_FRACTION,
) -> grain.MapDataset:
    """The documents of `source` in `split`, in a fixed order: a MapDataset of `str` (text
    sources) or of `np.ndarray` int32 token ids (ArrayRecord)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    if source == DEFAULT_SOURCE:
        keyed = stdlib_documents()
    else:
        files = _expand(source)
        token_files = [p for p in files if p.endswith(_TOKEN_SUFFIXES)]
        for path in files:
            if not path.endswith(_TEXT_SUFFIXES + _TOKEN_SUFFIXES):
                raise ValueError(
                    f"unsupported data file {path!r}: expected .txt, .jsonl, .parquet or "
                    ".arrayrecord"
                )
        if token_files:
            if len(token_files) != len(files):
                raise ValueError(f"data source {source!r} mixes ArrayRecord and text files")
            return _token_documents(source, token_files, split, validation_fraction)
        keyed = [
            (f"{os.path.basename(path)}:{i}", text)
            for path in files
            for i, text in enumerate(_read_text_file(path, text_field))
        ]
    in_val = np.array([_in_validation(k, validation_fraction) for k, _ in keyed], dtype=bool)
    texts = [text for (_, text), keep in zip(keyed, _keep(in_val, split), strict=True) if keep]
    if not texts:
        raise ValueError(f"data source {source!r} has no documents in split {split!r}")
    return grain.MapDataset.source(texts)


class _ReadRecord:
    """Index -> int32 token ids of that ArrayRecord record (a class so it pickles to workers)."""

    def __init__(self, data_source):
        self.data_source = data_source

    def __call__(self, index: int) -> np.ndarray:
        return np.frombuffer(self.data_source[int(index)], dtype="<i4").astype(np.int32)


def _token_documents(source, files, split, validation_fraction) -> grain.MapDataset:
    data_source = grain.sources.ArrayRecordDataSource(files)
    index = np.arange(len(data_source), dtype=np.int64)
    kept = index[_keep(_index_in_validation(index, validation_fraction), split)]
    if not len(kept):
        raise ValueError(f"data source {source!r} has no documents in split {split!r}")
    return grain.MapDataset.source(kept.tolist()).map(_ReadRecord(data_source))


def write_token_documents(path: str, documents: Iterable[Sequence[int]]) -> None:
    """Write tokenized documents as an ArrayRecord file `load_documents` reads (no EOS)."""
    from array_record.python.array_record_module import ArrayRecordWriter

    writer = ArrayRecordWriter(path, "group_size:1")  # one record per chunk: cheap random access
    try:
        for ids in documents:
            writer.write(np.asarray(ids, dtype="<i4").tobytes())
    finally:
        writer.close()


# ----------------------------------------------------------------------------- pipeline


class _Tokenize:
    """Document (text or ids) -> int32 ids with EOS appended."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, doc: str | np.ndarray) -> np.ndarray:
        tok = self.tokenizer
        if isinstance(doc, str):
            encode_np = getattr(tok, "encode_np", None)
            ids = encode_np(doc) if encode_np else np.asarray(tok.encode(doc), dtype=np.int32)
        else:
            ids = doc
            if ids.size and (ids.min() < 0 or ids.max() >= tok.vocab_size):
                raise ValueError(
                    f"token id {int(ids.max())} outside the tokenizer's vocabulary "
                    f"[0, {tok.vocab_size}); was the ArrayRecord written with another tokenizer?"
                )
        return np.append(ids, np.int32(tok.eos_id)).astype(np.int32)


class _SplitIntoChunks(grain.experimental.FlatMapTransform):
    """ids -> [{'tokens': chunk}] with chunks of at most seq_len: each packs as a document."""

    max_fan_out = 1 << 20  # only MapDataset flat maps check it; documents may be long

    def __init__(self, seq_len: int):
        self.seq_len = seq_len

    def flat_map(self, ids: np.ndarray) -> list[dict[str, np.ndarray]]:
        return [{"tokens": ids[i : i + self.seq_len]} for i in range(0, len(ids), self.seq_len)]


def _rename_packed(row: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {
        "tokens": row["tokens"].astype(np.int32),
        "segment_ids": row["tokens_segment_ids"].astype(np.int32),
        "positions": row["tokens_positions"].astype(np.int32),
    }


class _FixedBatchesIterator(grain.DatasetIterator):
    """Pads a short last batch with padding rows (segment 0) and, given num_batches, yields
    exactly that many batches (all-padding ones after the data runs out), so every process
    runs the same number of evaluation steps."""

    def __init__(self, parent, batch_size: int, seq_len: int, num_batches: int | None):
        super().__init__(parent)
        self._batch_size, self._seq_len, self._num_batches = batch_size, seq_len, num_batches
        self._emitted = 0

    def _padding(self, rows: int) -> dict[str, np.ndarray]:
        zeros = np.zeros((rows, self._seq_len), dtype=np.int32)
        return {"tokens": zeros, "segment_ids": zeros.copy(), "positions": zeros.copy()}

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
    def __init__(self, parent, batch_size: int, seq_len: int, num_batches: int | None):
        super().__init__(parent)
        self._args = (batch_size, seq_len, num_batches)

    def __iter__(self) -> _FixedBatchesIterator:
        return _FixedBatchesIterator(self._parent.__iter__(), *self._args)


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
) -> grain.IterDataset:
    """The batches of `source`/`split` for this process, as a Grain IterDataset.

    Args:
      source: 'default' or a path/directory/glob (module docstring).
      split: 'train', 'validation' or 'all'.
      tokenizer: from `training.tokenizers.make_tokenizer`.
      seq_len: T, the length of each packed row.
      global_batch_size: rows per step over all processes; each process gets
        global_batch_size // process_count of them.
      seed: seeds the document shuffle (reshuffled every epoch) and the order of packed rows.
      process_index, process_count: this process's document shard; default jax.process_index()
        and jax.process_count().
      num_workers: worker processes for reading and tokenizing (0 = in this process). Needs absl
        flags parsed (run under absl.app.run). Does not change the batches.
      shuffle: default True for 'train', False otherwise.
      repeat: repeat forever; default True for 'train'. Otherwise one pass, the last batch padded.
      num_batches: yield exactly this many batches; without repeat, all-padding batches follow
        when the data runs out, so all processes agree on the number of evaluation steps.
      text_field: the JSONL field / Parquet column holding the text.
      validation_fraction: share of documents in 'validation'.
      num_packing_bins: rows packed at once; default max(local batch, 16). More bins pack
        tighter.
      shuffle_window: chunks shuffled together after chunking (when shuffling). Memory is
        about shuffle_window * seq_len * 4 bytes; a restore replays at most one window.

    `iter(dataset)` gives a grain DatasetIterator of dicts of int32 arrays [B, T] (`tokens`,
    `segment_ids`, `positions`) with JSON-able `get_state()` / `set_state()`; `make_dataset`
    returns that iterator directly.
    """
    process_index = jax.process_index() if process_index is None else process_index
    process_count = jax.process_count() if process_count is None else process_count
    if global_batch_size % process_count:
        raise ValueError(
            f"global_batch_size={global_batch_size} is not divisible by the "
            f"{process_count} processes"
        )
    batch_size = global_batch_size // process_count
    shuffle = split == "train" if shuffle is None else shuffle
    repeat = split == "train" if repeat is None else repeat

    docs = load_documents(
        source, split, text_field=text_field, validation_fraction=validation_fraction
    )
    docs = docs[process_index::process_count]
    if not len(docs):
        raise ValueError(
            f"data source {source!r} split {split!r} has fewer documents than the "
            f"{process_count} processes"
        )
    if shuffle:
        docs = docs.shuffle(seed=seed)
    if repeat:
        docs = docs.repeat(None)  # reseeds the shuffle every epoch
    ds = docs.map(_Tokenize(tokenizer)).to_iter_dataset()
    if num_workers > 0:
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=num_workers))
    ds = grain.experimental.FlatMapIterDataset(ds, _SplitIntoChunks(seq_len))
    if shuffle and shuffle_window > 1:
        ds = grain.experimental.WindowShuffleIterDataset(ds, window_size=shuffle_window, seed=seed)
    ds = grain.experimental.FirstFitPackIterDataset(
        ds,
        length_struct={"tokens": seq_len},
        num_packing_bins=num_packing_bins or max(batch_size, 16),
        seed=seed,
        shuffle_bins=shuffle,
    )
    ds = ds.map(_rename_packed).batch(batch_size, drop_remainder=repeat)
    if not repeat:
        ds = _FixedBatches(ds, batch_size, seq_len, num_batches)
    elif num_batches is not None:
        ds = grain.experimental.LimitIterDataset(ds, num_batches)
    return ds


def make_dataset(*args, **kwargs) -> grain.DatasetIterator:
    """`iter(build_dataset(...))`: the iterator to train or evaluate on, and to checkpoint
    (`get_state()` / `set_state()`, or grain.checkpoint.CheckpointSave/Restore with Orbax).
    Takes exactly the arguments of `build_dataset`."""
    return iter(build_dataset(*args, **kwargs))
