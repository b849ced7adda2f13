"""Documents for training and evaluation, from a `source` string, split into train and validation.

Sources:
  'default'   real text that every Python carries and needs no download: the `.py` files of the
              running interpreter's standard library (test folders and site-packages left out),
              in sorted order, capped at `DEFAULT_MAX_BYTES`. One file = one document. The corpus
              is fixed for a given Python version.
  a path, a directory or a glob (`~` and `**` allowed), of files ending in
    .txt      one document per paragraph: runs of text separated by a blank line.
    .jsonl    one document per line: a JSON object whose field `text_field` (default 'text') is
              the text.
    .parquet  one document per row, the string in column `text_field` (read with pyarrow).
    .arrayrecord / .array_record
              already tokenized: one record per document, its token ids as little-endian int32
              bytes (`np.asarray(ids, '<i4').tobytes()`), without EOS. `write_token_documents`
              writes this format.
  Every kind is read lazily, a document when it is asked for, so corpora larger than memory
  work: the text formats through an index of where each document lies, built in one streaming
  pass per file and cached (nnx_zoo/data/text_index.py, nnx_zoo/data/text_source.py). An empty
  text reads as '' and becomes no tokens (the pipeline skips it).
  a token store: a directory holding `index.json`, written by `zoo-data` (data/token_store.py):
              documents by number, the tokenizer's identity checked by the pipeline.
  A path that does not exist, or a glob matching nothing, raises UsageError naming it; a
  file that cannot be read as its kind raises UsageError naming the file (and the line, for
  text: bytes that are not UTF-8 at start; a JSONL line that is not an object with the text
  field when it is read, the first line of each file at start).

Split: each document has a key (its file path relative to the stdlib, `name:index` for user
files -- index counting the file's non-blank lines or paragraphs, so the split needs no text
read --, its record index for ArrayRecord); a hash of the key puts `validation_fraction` of the
documents in 'validation' and the rest in 'train', the same on every machine. 'all' keeps every
document (for a file that is itself held-out data).
"""

from __future__ import annotations

import glob
import json
import os
import re
import sysconfig
import zlib
from collections.abc import Iterable, Sequence
from functools import partial

import grain
import numpy as np

from nnx_zoo.data import text_index, token_store
from nnx_zoo.data.text_source import TextDocuments
from nnx_zoo.errors import UsageError
from nnx_zoo.runtime import storage

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
    if storage.is_url(source):
        return [storage.local_copy(url) for url in _expand_url(source)]
    path = os.path.expanduser(source)
    if os.path.isdir(path):
        suffixes = _TEXT_SUFFIXES + _TOKEN_SUFFIXES
        files = glob.glob(os.path.join(path, "**", "*"), recursive=True)
        files = [p for p in files if p.endswith(suffixes) and os.path.isfile(p)]
        if not files:
            raise UsageError(f"data directory {source!r} holds no {suffixes} files")
        return sorted(files)
    if glob.has_magic(path):
        files = sorted(p for p in glob.glob(path, recursive=True) if os.path.isfile(p))
        if not files:
            raise UsageError(f"data glob {source!r} matches no files")
        return files
    if not os.path.exists(path):
        raise UsageError(f"data path {source!r} does not exist")
    return [path]


def _decode(raw: bytes, path: str, line_no: int | None = None) -> str:
    """UTF-8 text of `raw`; UsageError naming the file and line of the first bad byte."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = line_no if line_no is not None else raw[: e.start].count(b"\n") + 1
        raise UsageError(
            f"{path}:{line}: not UTF-8 text (byte 0x{raw[e.start]:02x}); data files must be UTF-8"
        ) from None


def _expand_url(source: str) -> list[str]:
    """The objects a gs:// / s3:// source names: one object, every data file under a prefix,
    or a glob's matches; UsageError (one line) naming the URL when there are none."""
    suffixes = _TEXT_SUFFIXES + _TOKEN_SUFFIXES
    scheme = source.split("://", 1)[0]
    try:
        if glob.has_magic(source):
            fs = storage.filesystem(source)
            found = [f"{scheme}://{p}" for p in sorted(fs.glob(source.split("://", 1)[1]))]
            files = [u for u in found if u.endswith(suffixes)]
            if not files:
                raise UsageError(f"data glob {source!r} matches no files")
            return files
        if storage.isfile(source):
            return [source]
        rels = storage.walk_files(source)
    except UsageError:
        raise
    except Exception as e:  # noqa: BLE001 -- the store's own failure: the URL and its message
        raise storage.error(source, e, "be read") from None
    files = [storage.join(source, r) for r in rels if r.endswith(suffixes)]
    if not files:
        raise UsageError(f"data source {source!r} holds no {suffixes} objects")
    return files


def jsonl_records(path: str):
    """(line number, parsed JSON) for each non-blank line of a JSONL file; a line that is not
    UTF-8 or not JSON is a UsageError naming the file and line."""
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            line = _decode(raw, path, line_no)
            if not line.strip():
                continue
            try:
                yield line_no, json.loads(line)
            except json.JSONDecodeError as e:
                raise UsageError(
                    f"{path}:{line_no}: not valid JSON at column {e.colno} ({e.msg})"
                ) from None


def _check_text_column(path: str, schema, text_field: str) -> None:
    """A Parquet file's text column must exist and hold strings (checked at start)."""
    import pyarrow

    if text_field not in schema.names:
        raise UsageError(
            f"{path}: no column {text_field!r} (columns: {schema.names}); set data.text_field "
            "to the column that holds the text"
        )
    kind = schema.field(text_field).type
    if not (pyarrow.types.is_string(kind) or pyarrow.types.is_large_string(kind)):
        raise UsageError(
            f"{path}: column {text_field!r} holds {kind}, not strings; data.text_field "
            f"must name a text column (columns: {schema.names})"
        )


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
        raise UsageError(f"unknown split {split!r}; expected one of {SPLITS}")
    if source == DEFAULT_SOURCE:
        return _default_documents(split, validation_fraction)
    if token_store.is_store(source):
        return _store_documents(source, split, validation_fraction)
    files = _expand(source)
    token_files = [p for p in files if p.endswith(_TOKEN_SUFFIXES)]
    for path in files:
        if not path.endswith(_TEXT_SUFFIXES + _TOKEN_SUFFIXES):
            raise UsageError(
                f"unsupported data file {path!r}: expected .txt, .jsonl, .parquet or .arrayrecord"
            )
    if token_files:
        if len(token_files) != len(files):
            raise UsageError(f"data source {source!r} mixes ArrayRecord and text files")
        return _token_documents(source, token_files, split, validation_fraction)
    return _text_documents(source, files, split, text_field, validation_fraction)


def _default_documents(split: str, validation_fraction: float) -> grain.MapDataset:
    """The standard library's files, in memory (16 MB at most)."""
    keyed = stdlib_documents()
    in_val = _both_sides([_in_validation(k, validation_fraction) for k, _ in keyed])
    texts = [text for (_, text), keep in zip(keyed, _keep(in_val, split), strict=True) if keep]
    if not texts:
        raise UsageError(_no_documents(DEFAULT_SOURCE, split, len(keyed), validation_fraction))
    return grain.MapDataset.source(texts)


def _text_documents(source, files, split, text_field, validation_fraction) -> grain.MapDataset:
    """The documents of text files, read when asked for (nnx_zoo/data/text_source.py)."""
    indexes = [
        text_index.index_file(p, text_field, partial(_check_text_column, text_field=text_field))
        for p in files
    ]
    buckets = np.concatenate([ix.buckets for ix in indexes])
    every = _no_text_error(source, text_field)
    if not len(buckets):
        raise every
    for f, ix in enumerate(indexes):  # a wrong data.text_field shows on the first line
        if ix.kind == "jsonl" and len(ix):
            first = sum(len(x) for x in indexes[:f])
            TextDocuments(indexes, np.array([first]), text_field)[0]
    in_val = _both_sides(buckets < validation_fraction * 10_000)
    ids = np.flatnonzero(_keep(in_val, split))
    if not len(ids):
        raise UsageError(_no_documents(source, split, len(buckets), validation_fraction))
    docs = TextDocuments(indexes, ids, text_field)
    if not _any_text(docs):  # empty texts read as '' (no document); not one text in the split
        if split == "all" or not _any_text(
            TextDocuments(indexes, np.arange(len(buckets)), text_field)
        ):
            raise every
        if split == "validation":
            raise NoValidationSplitError(
                f"data source {source!r} has no text in split 'validation': its "
                f"{len(ids)} documents there are empty"
            )
        raise UsageError(
            f"data source {source!r} has no text in split {split!r}: every text there is empty"
        )
    return grain.MapDataset.source(docs)


def _no_text_error(source: str, text_field: str) -> ValueError:
    return UsageError(
        f"data source {source!r} holds no documents: every text is empty "
        f"(data.text_field={text_field!r} names the text)"
    )


def _any_text(docs) -> bool:
    """Whether any document is not empty: reads until one is (the first, but for odd data)."""
    return any(docs[i] for i in range(len(docs)))


def _both_sides(in_validation) -> np.ndarray:
    """The hash's split, made to leave both sides non-empty when there are two documents or
    more: if every document hashed into one side, the first moves to the other. A source of
    one document trains on it and has no validation split (the run then skips validation,
    with a warning), so no `validation_fraction` can empty the training split."""
    in_val = np.array(in_validation, dtype=bool)
    if len(in_val) == 1:
        in_val[0] = False
    elif len(in_val) > 1 and (in_val.all() or not in_val.any()):
        in_val[0] = not in_val[0]
    return in_val


class NoValidationSplitError(UsageError):
    """A source of one document: it is all training data; a run skips validation."""


def _no_documents(source: str, split: str, total: int, fraction: float) -> str:
    message = f"data source {source!r} has no documents in split {split!r}"
    if split == "validation" and total == 1:
        raise NoValidationSplitError(
            f"{message}: its one document is the training data (add documents to validate)"
        )
    if split == "validation" and total:
        message += (
            f": none of its {total} documents hashed into the validation share {fraction:g}; "
            "raise "
            f"data.validation_fraction (e.g. --config.data.validation_fraction="
            f"{min(0.5, max(2 * fraction, 2 / total)):.2g})"
        )
    return message


class _ReadRecord:
    """Index -> int32 token ids of that ArrayRecord record (a class so it pickles to workers)."""

    def __init__(self, data_source):
        self.data_source = data_source

    def __call__(self, index: int) -> np.ndarray:
        return np.frombuffer(self.data_source[int(index)], dtype="<i4").astype(np.int32)


def _token_documents(source, files, split, validation_fraction) -> grain.MapDataset:
    data_source = grain.sources.ArrayRecordDataSource(files)
    index = np.arange(len(data_source), dtype=np.int64)
    kept = index[_keep(_both_sides(_index_in_validation(index, validation_fraction)), split)]
    if not len(kept):
        raise UsageError(_no_documents(source, split, len(index), validation_fraction))
    return grain.MapDataset.source(kept.tolist()).map(_ReadRecord(data_source))


class _ReadStoreDocument:
    """Document number -> its int32 ids (a class so it pickles to workers)."""

    def __init__(self, store):
        self.store = store

    def __call__(self, number: int) -> np.ndarray:
        return self.store.read([number])[0][0]


def _store_documents(source, split, validation_fraction) -> grain.MapDataset:
    store = token_store.TokenStore(source)
    if store.with_mask:
        raise UsageError(
            f"data.source={source!r} holds {store.index['data_format']} records; set "
            f"--config.data.format={store.index['data_format']}"
        )
    index = np.arange(len(store), dtype=np.int64)
    kept = index[_keep(_both_sides(_index_in_validation(index, validation_fraction)), split)]
    if not len(kept):
        raise UsageError(_no_documents(source, split, len(index), validation_fraction))
    return grain.MapDataset.source(kept.tolist()).map(_ReadStoreDocument(store))


def write_token_documents(path: str, documents: Iterable[Sequence[int]]) -> None:
    """Write tokenized documents as an ArrayRecord file `load_documents` reads (no EOS)."""
    from array_record.python.array_record_module import ArrayRecordWriter

    writer = ArrayRecordWriter(path, "group_size:1")  # one record per chunk: cheap random access
    try:
        for ids in documents:
            writer.write(np.asarray(ids, dtype="<i4").tobytes())
    finally:
        writer.close()
