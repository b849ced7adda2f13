"""Where each document of a text file lies, found in one streaming pass: the byte range of each
non-blank JSONL line or `.txt` paragraph, or the row-group sizes of a Parquet file.

The pass reads a file in blocks of `BLOCK_BYTES`, so its memory is a block (or one paragraph or
line longer than a block) plus the index: two int64 offsets per document and the hash bucket of
its split key (nnx_zoo/data/sources.py), 18 bytes per document. It also checks that the bytes
are UTF-8, so a bad byte is still an error naming file:line before the first step; what needs
the text parsed (JSON, the text field) is checked when the document is read
(nnx_zoo/data/text_source.py), apart from the first line of each file, which is read at start.

A document is what the in-memory reader of earlier versions made one of: a JSONL line or a
paragraph (text between blank lines, `\\n` then spaces/tabs then `\\n`; CRLF line ends count
too) whose text is not all white space. Its number `i` in the file (the split key
`basename:i`) counts such lines and paragraphs; a JSONL line whose text field turns out empty
when read is no document, but keeps its number, so the split never needs the texts.

A pass that takes longer than `PROGRESS_AFTER_S` prints a line on stderr every
`PROGRESS_EVERY_S` (MB scanned, documents found). Indexes of files of `CACHE_MIN_BYTES` or
more are cached, keyed by the file's real path, size and modification time, under
`$ZOO_DATA_CACHE` (default `$XDG_CACHE_HOME/nnx_zoo/text_index`, else
`~/.cache/nnx_zoo/text_index`; `ZOO_DATA_CACHE=off` turns the cache off). Nothing is ever
written beside the data. A cache that cannot be written or read is passed over silently: it
only saves a rescan.
"""

from __future__ import annotations

import codecs
import hashlib
import os
import re
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass

import numpy as np

from nnx_zoo.errors import UsageError

BLOCK_BYTES = 8 << 20
PROGRESS_AFTER_S = 1.5
PROGRESS_EVERY_S = 5.0
CACHE_MIN_BYTES = 8 << 20
CACHE_ENV = "ZOO_DATA_CACHE"
_CACHE_VERSION = 1  # bumped when what an index holds, or how it is found, changes

# A paragraph break: a line end, then only spaces / tabs (and the CR of CRLF), then a line end.
PARAGRAPH_BREAK = re.compile(rb"\n[ \t\r]*\n")
# Characters stripped from a paragraph's ends (LF and CRLF line ends).
PARAGRAPH_STRIP = b"\r\n"
# Bytes that are a non-white-space character on their own (ASCII, not str.isspace()): a piece
# holding one is not blank. A piece without any is decoded and str.strip()'ed to tell.
_SURE_TEXT = np.ones(256, dtype=bool)
_SURE_TEXT[[ord(c) for c in " \t\n\r\x0b\x0c\x1c\x1d\x1e\x1f"]] = False
_SURE_TEXT[0x80:] = False
_ASCII_TEXT = re.compile(rb"[^\t\n\x0b\x0c\r\x1c-\x1f \x80-\xff]")


@dataclass(frozen=True)
class FileIndex:
    """One file's documents. Text: `starts`/`ends` byte offsets ([start, end) of the line or
    paragraph, before stripping). Parquet: `group_rows`, the rows of each row group; a
    document is a row. `buckets`: crc32 of each document's split key mod 10,000."""

    path: str
    kind: str  # 'jsonl' | 'txt' | 'parquet'
    buckets: np.ndarray
    starts: np.ndarray | None = None
    ends: np.ndarray | None = None
    group_rows: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.buckets)


def kind_of(path: str) -> str:
    return os.path.splitext(path)[1].lstrip(".")


def split_buckets(basename: str, count: int) -> np.ndarray:
    """crc32(f'{basename}:{i}') % 10,000 for i < count: the hash split's buckets
    (sources._in_validation keys each document of a user file so)."""
    prefix = zlib.crc32(f"{basename}:".encode())
    crc = zlib.crc32
    return np.fromiter(
        (crc(str(i).encode(), prefix) % 10_000 for i in range(count)), np.uint16, count
    )


def line_of(path: str, offset: int) -> int:
    """The 1-based line number of byte `offset` of `path` (for an error, so not stored)."""
    lines, done = 1, 0
    with open(path, "rb") as f:
        while done < offset:
            block = f.read(min(BLOCK_BYTES, offset - done))
            if not block:
                break
            lines += block.count(b"\n")
            done += len(block)
    return lines


def _utf8_error(path: str, region: bytes, lines_before: int, error: UnicodeDecodeError):
    line = lines_before + region[: error.start].count(b"\n") + 1
    return UsageError(
        f"{path}:{line}: not UTF-8 text (byte 0x{region[error.start]:02x}); data files must be "
        "UTF-8"
    )


def _not_blank(buf: bytes, starts: np.ndarray, ends: np.ndarray, strip: bytes) -> np.ndarray:
    """For each piece buf[start:end]: does it hold a non-white-space character? Most pieces
    start with one (a JSONL line with '{'); the others are searched, and decoded when they
    hold no ASCII text."""
    arr = np.frombuffer(buf, np.uint8)
    keep = np.zeros(len(starts), bool)
    filled = ends > starts
    keep[filled] = _SURE_TEXT[arr[starts[filled]]]
    for j in np.flatnonzero(filled & ~keep):
        start, end = int(starts[j]), int(ends[j])
        keep[j] = _ASCII_TEXT.search(buf, start, end) is not None or bool(
            buf[start:end].strip(strip).decode("utf-8").strip()
        )
    return keep


class _Progress:
    def __init__(self, path: str, size: int):
        self.path, self.size = path, size
        self.start = time.monotonic()
        self.last = None  # when a line was last printed; None: not yet

    def update(self, done: int, documents: int, final: bool = False) -> None:
        now = time.monotonic()
        waited = now - (self.start if self.last is None else self.last)
        due = PROGRESS_AFTER_S if self.last is None else PROGRESS_EVERY_S
        if waited < due and not (final and self.last is not None):
            return
        self.last = now
        elapsed = now - self.start
        rate = done / 2**20 / max(elapsed, 1e-9)
        what = "indexed" if final else "indexing"
        print(
            f"data: {what} {self.path}: {done / 2**20:,.0f} of {self.size / 2**20:,.0f} MB, "
            f"{documents:,} documents, {elapsed:.1f} s ({rate:,.0f} MB/s)",
            file=sys.stderr,
            flush=True,
        )


def _scan_text(path: str, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """[start, end) byte offsets of the non-blank lines (jsonl) or paragraphs (txt)."""
    size = os.path.getsize(path)
    progress = _Progress(path, size)
    starts_parts, ends_parts, found = [], [], 0
    # Carried between blocks: the bytes of the piece still open, from file offset `base`.
    carry, base, lines_before = b"", 0, 0
    search_from = 0  # in `carry`: no paragraph break starts before it (txt)
    decoder = codecs.getincrementaldecoder("utf-8")()
    with open(path, "rb", buffering=0) as f:
        while True:
            block = f.read(BLOCK_BYTES)
            buf = carry + block if carry else block
            last = not block
            if kind == "jsonl":
                nl = np.flatnonzero(np.frombuffer(buf, np.uint8) == 10)
                piece_starts = np.concatenate([[0], nl + 1])
                piece_ends = np.concatenate([nl, [len(buf)]])
                strip, cut = b"", (int(nl[-1]) + 1 if len(nl) else 0)
                if not last:  # the piece after the last line end is still open
                    piece_starts, piece_ends = piece_starts[:-1], piece_ends[:-1]
            else:
                breaks = [(m.start(), m.end()) for m in PARAGRAPH_BREAK.finditer(buf, search_from)]
                piece_starts = np.array([0] + [e for _, e in breaks], np.int64)
                piece_ends = np.array([s for s, _ in breaks] + [len(buf)], np.int64)
                strip, cut = PARAGRAPH_STRIP, (breaks[-1][1] if breaks else 0)
                if not last:
                    piece_starts, piece_ends = piece_starts[:-1], piece_ends[:-1]
                    # A break may start at the last line end and go on in the next block;
                    # none starts before it.
                    last_nl = buf.rfind(b"\n", cut)
                    search_from = (last_nl if last_nl >= 0 else len(buf)) - cut
            if last:
                cut = len(buf)
            region = buf[:cut]
            try:
                decoder.decode(region, final=last)
            except UnicodeDecodeError as e:
                raise _utf8_error(path, region, lines_before, e) from None
            if len(piece_starts):
                keep = _not_blank(buf, piece_starts, piece_ends, strip)
                starts_parts.append(base + piece_starts[keep])
                ends_parts.append(base + piece_ends[keep])
                found += int(keep.sum())
            lines_before += region.count(b"\n")
            base += cut
            carry = buf[cut:]
            progress.update(base, found)
            if last:
                break
    progress.update(size, found, final=True)
    if not starts_parts:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return (
        np.concatenate(starts_parts).astype(np.int64),
        np.concatenate(ends_parts).astype(np.int64),
    )


def _parquet_rows(path: str, text_field: str, check_type) -> np.ndarray:
    import pyarrow
    import pyarrow.parquet as pq

    from nnx_zoo.runtime.console import one_line

    try:
        meta = pq.ParquetFile(path)
        check_type(path, meta.schema_arrow)
        return np.array(
            [meta.metadata.row_group(g).num_rows for g in range(meta.num_row_groups)], np.int64
        )
    except pyarrow.ArrowException as e:
        raise UsageError(f"{path}: not a readable Parquet file ({one_line(e)})") from None


def _cache_dir() -> str | None:
    configured = os.environ.get(CACHE_ENV, "")
    if configured.lower() == "off":
        return None
    if configured:
        return os.path.expanduser(configured)
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "nnx_zoo", "text_index")


def _cache_path(path: str, kind: str) -> str | None:
    directory = _cache_dir()
    if directory is None:
        return None
    st = os.stat(path)
    key = f"{_CACHE_VERSION}|{os.path.realpath(path)}|{st.st_size}|{st.st_mtime_ns}|{kind}"
    return os.path.join(directory, hashlib.sha256(key.encode()).hexdigest()[:32] + ".npz")


def _load_cached(cache: str, path: str, kind: str) -> FileIndex | None:
    try:
        with np.load(cache) as z:
            arrays = {k: z[k] for k in z.files}
        return FileIndex(path=path, kind=kind, **arrays)
    except Exception:  # noqa: BLE001 -- absent, partial or foreign: rescan
        return None


def _store(cache: str, index: FileIndex) -> None:
    arrays = {"buckets": index.buckets}
    if index.starts is not None:
        arrays |= {"starts": index.starts, "ends": index.ends}
    try:
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(cache), suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(f, **arrays)
            os.replace(tmp, cache)  # whole or not at all
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError:  # read-only home, full disk: the next run scans again
        pass


def index_file(path: str, text_field: str, check_type) -> FileIndex:
    """The index of one .jsonl / .txt / .parquet file (from the cache when it is there).
    `check_type(path, arrow_schema)` checks a Parquet file's text column (raises UsageError)."""
    kind = kind_of(path)
    if kind == "parquet":
        # The metadata is read anyway (the schema check): only the buckets are worth caching.
        group_rows = _parquet_rows(path, text_field, check_type)
        count = int(group_rows.sum())
        buckets = _cached_or(
            path,
            kind,
            lambda: FileIndex(path, kind, split_buckets(os.path.basename(path), count)),
            count,
        ).buckets
        return FileIndex(path, kind, buckets, group_rows=group_rows)
    return _cached_or(path, kind, lambda: _scan(path, kind), None)


def _scan(path: str, kind: str) -> FileIndex:
    starts, ends = _scan_text(path, kind)
    return FileIndex(path, kind, split_buckets(os.path.basename(path), len(starts)), starts, ends)


def _cached_or(path: str, kind: str, build, expected_count: int | None) -> FileIndex:
    cache = _cache_path(path, kind) if os.path.getsize(path) >= CACHE_MIN_BYTES else None
    if cache is not None:
        index = _load_cached(cache, path, kind)
        if index is not None and (expected_count is None or len(index) == expected_count):
            return index
    index = build()
    if cache is not None:
        _store(cache, index)
    return index
