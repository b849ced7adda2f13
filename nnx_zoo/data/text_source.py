"""Random access to the documents of `.jsonl`, `.txt` and `.parquet` files, read when asked for.

`TextDocuments[i]` reads one document: the bytes of its line or paragraph (`os.pread`, so
Grain's read threads share a file), or its row from a Parquet row group (the last
`PARQUET_CACHED_GROUPS` row groups read are kept, per process). It holds file paths and the
kept documents' offsets (nnx_zoo/data/text_index.py), about 20 bytes a document and never a
text, so pickling it to Grain's worker processes copies no data, and host memory grows with
neither the corpus nor `data.num_workers`.

A JSONL line that is not JSON, or not an object with a string text field, is a
`DataFileError` (a UsageError) naming file:line when it is read, as is a Parquet row group
that cannot be read: found mid-training, it is still the user's data, and train_main ends
with exit status 2 and that line; one whose text is empty (or a Parquet null / empty string)
reads as '' -- no document: the pipeline's tokenizer turns '' into no tokens, and the chunker
hands nothing on for it.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import threading

import numpy as np

from nnx_zoo.data.text_index import PARAGRAPH_STRIP, FileIndex, line_of
from nnx_zoo.errors import UsageError


class DataFileError(UsageError):
    """A document of a data file that cannot be read (one line naming file:line), found when
    it is read, which may be after the first step."""


PARQUET_CACHED_GROUPS = 2
# Grain reads hundreds of documents ahead, and a source that repeats asks for the same one
# again and again: each read of a large text would be a copy of its own (a 50 MB line, read
# ahead by every read thread, took gigabytes). Texts of this many bytes or more are kept, up
# to LARGE_CACHE_BYTES in all, so a repeated read hands back the same string.
LARGE_TEXT_BYTES = 1 << 20
LARGE_CACHE_BYTES = 256 << 20


class TextDocuments:
    """The documents `ids` (numbers over the files' documents in order) of `indexes`' files."""

    def __init__(self, indexes: list[FileIndex], ids: np.ndarray, text_field: str):
        self._paths = [ix.path for ix in indexes]
        self._kinds = [ix.kind for ix in indexes]
        self._text_field = text_field
        firsts = np.cumsum([0] + [len(ix) for ix in indexes])
        ids = np.asarray(ids, np.int64)
        file_of = np.searchsorted(firsts, ids, side="right") - 1
        local = ids - firsts[file_of]
        self._file = file_of.astype(np.int32)
        self._start = np.zeros(len(ids), np.int64)
        self._end = np.zeros(len(ids), np.int64)
        # Parquet: the first row of each row group (and the end), per file.
        self._group_first: dict[int, np.ndarray] = {}
        for f, ix in enumerate(indexes):
            mine = file_of == f
            if ix.kind == "parquet":
                self._start[mine] = local[mine]  # the row in the file
                self._group_first[f] = np.cumsum(np.concatenate([[0], ix.group_rows]))
            else:
                self._start[mine] = ix.starts[local[mine]]
                self._end[mine] = ix.ends[local[mine]]
        self._open()

    def _open(self) -> None:
        self._lock = threading.RLock()  # a large read opens its file under it
        self._fds: dict[int, int] = {}
        self._parquet: dict[int, object] = {}
        self._groups: collections.OrderedDict = collections.OrderedDict()
        self._large: collections.OrderedDict = collections.OrderedDict()  # i -> (text, bytes)
        self._large_bytes = 0

    def __getstate__(self):
        # File handles and cached row groups stay in the process that opened them.
        return {
            k: v
            for k, v in self.__dict__.items()
            if k not in ("_lock", "_fds", "_parquet", "_groups", "_large", "_large_bytes")
        }

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._open()

    def __del__(self):
        for fd in getattr(self, "_fds", {}).values():
            with contextlib.suppress(OSError):
                os.close(fd)

    def __len__(self) -> int:
        return len(self._file)

    def __getitem__(self, index: int) -> str:
        i = int(index)
        f = int(self._file[i])
        if self._kinds[f] == "parquet":
            return self._parquet_text(f, int(self._start[i]))
        start, end = int(self._start[i]), int(self._end[i])
        if end - start < LARGE_TEXT_BYTES:
            return self._read_text(f, start, end)
        with self._lock:  # one read of a large text at a time, and its string shared
            if i in self._large:
                self._large.move_to_end(i)
                return self._large[i][0]
            text = self._read_text(f, start, end)
            self._large[i] = (text, end - start)
            self._large_bytes += end - start
            while self._large_bytes > LARGE_CACHE_BYTES and len(self._large) > 1:
                self._large_bytes -= self._large.popitem(last=False)[1][1]
            return text

    def _read_text(self, f: int, start: int, end: int) -> str:
        raw = os.pread(self._fd(f), end - start, start)
        if self._kinds[f] == "txt":
            return raw.strip(PARAGRAPH_STRIP).decode("utf-8")
        return self._jsonl_text(f, raw, start)

    def _fd(self, f: int) -> int:
        fd = self._fds.get(f)
        if fd is None:
            with self._lock:
                fd = self._fds.get(f)
                if fd is None:
                    fd = self._fds[f] = os.open(self._paths[f], os.O_RDONLY)
        return fd

    def _jsonl_text(self, f: int, raw: bytes, start: int) -> str:
        path, field = self._paths[f], self._text_field
        try:
            record = json.loads(raw.decode("utf-8"))
        except json.JSONDecodeError as e:
            raise DataFileError(
                f"{path}:{line_of(path, start)}: not valid JSON at column {e.colno} ({e.msg})"
            ) from None
        if not isinstance(record, dict) or not isinstance(record.get(field), str):
            got = (
                f"an object without a string {field!r}"
                if isinstance(record, dict)
                else json.dumps(record)[:40]
            )
            raise DataFileError(
                f"{path}:{line_of(path, start)}: expected a JSON object with a string field "
                f"{field!r} (data.text_field), got {got}"
            )
        return record[field]

    def _parquet_text(self, f: int, row: int) -> str:
        firsts = self._group_first[f]
        group = int(np.searchsorted(firsts, row, side="right")) - 1
        with self._lock:  # one reader per row group, not one per thread that wants it
            column = self._groups.get((f, group))
            if column is None:
                column = self._read_group(f, group)
                self._groups[(f, group)] = column
                while len(self._groups) > PARQUET_CACHED_GROUPS:
                    self._groups.popitem(last=False)
            else:
                self._groups.move_to_end((f, group))
        return column[row - int(firsts[group])].as_py() or ""

    def _read_group(self, f: int, group: int):
        import pyarrow
        import pyarrow.parquet as pq

        from nnx_zoo.runtime.console import one_line

        path = self._paths[f]
        try:
            handle = self._parquet.get(f)
            if handle is None:
                handle = self._parquet[f] = pq.ParquetFile(path)
            table = handle.read_row_group(group, columns=[self._text_field])
            return table.column(self._text_field).combine_chunks()
        except pyarrow.ArrowException as e:
            raise DataFileError(f"{path}: not a readable Parquet file ({one_line(e)})") from None
