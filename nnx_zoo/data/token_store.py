"""A pre-tokenized corpus on disk (what `zoo-data` writes, a `data.source` like any other).

A store is a directory:

  index.json               written last, atomically (temporary file + rename): a directory
                           without it is not a store (an unfinished or killed `zoo-data` run).
    format, version        'nnx-zoo-token-store', 1
    tokenizer              {spec: the data.tokenizer string, vocab_size, eos_id, fingerprint:
                           sha256 of the tokenizer's defining file (tokenizer.json / .model),
                           'byte' for the byte tokenizer}
    data_format            'text' | 'chat' | 'prompt_completion'
    text_field             the JSONL field / Parquet column the text came from
    documents, tokens      totals (tokens without EOS)
    sources                [{path, bytes}]: the files tokenized
    shards                 [{file, lengths, documents, tokens}] in corpus order
  shard-NNNNN.arrayrecord  one record per document (group_size:1, so any record is read alone):
                           text: its ids as little-endian int32, without EOS (the format
                           `sources.write_token_documents` writes). chat / prompt_completion:
                           the ids as little-endian int32, then one uint8 per token, 1 where the
                           token is a trained target (the loss mask of data/chat.py), so a
                           record of L tokens is 5L bytes; the ids are the encoded record's,
                           its own end markers included (nothing is appended when training).
  shard-NNNNN.lengths.npy  int32 [documents]: each document's token count, so the rows of a
                           concat-then-split stream are placed without reading any record.

Documents are numbered across the shards in order; that number keys the train / validation
hash (the one ArrayRecord sources use). A run whose tokenizer differs from the store's
(fingerprint or vocabulary size) is refused by `check_tokenizer` in one line naming both.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import threading

import numpy as np

from nnx_zoo.errors import UsageError
from nnx_zoo.runtime import storage

FORMAT = "nnx-zoo-token-store"
VERSION = 1
INDEX = "index.json"
# Reading a record touches its chunk alone: no readahead (it would read megabytes per row) and
# no footer prefetch (a megabyte per shard opened); the chunk index is read once per shard.
_READ_OPTIONS = "readahead_buffer_size:0,footer_prefetch_bytes:0"


def shard_name(i: int) -> str:
    return f"shard-{i:05d}.arrayrecord"


def lengths_name(i: int) -> str:
    return f"shard-{i:05d}.lengths.npy"


def _local(path: str) -> str:
    return path if storage.is_url(path) else os.path.expanduser(path)


def is_store(path: str) -> bool:
    """Whether `path` is a finished store (a directory, or a gs:// / s3:// prefix, holding
    index.json)."""
    if storage.is_url(path):
        return storage.isfile(storage.join(path, INDEX))
    return os.path.isfile(os.path.join(os.path.expanduser(path), INDEX))


# ----------------------------------------------------------------------------- tokenizers


def fingerprint(tokenizer) -> str:
    """sha256 of the file that defines `tokenizer` ('byte' for the byte tokenizer)."""
    path = getattr(tokenizer, "path", None)
    if path is None:
        return "byte"
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def tokenizer_identity(tokenizer, spec: str) -> dict:
    return {
        "spec": spec,
        "vocab_size": int(tokenizer.vocab_size),
        "eos_id": int(tokenizer.eos_id),
        "fingerprint": fingerprint(tokenizer),
    }


def _describe(identity: dict) -> str:
    return (
        f"{identity['spec']!r} (vocab {identity['vocab_size']}, eos {identity['eos_id']}, "
        f"sha256 {identity['fingerprint'][:12]})"
    )


def check_tokenizer(store_path: str, index: dict, tokenizer) -> None:
    """UsageError (one line, both tokenizers named) unless `tokenizer` is the store's."""
    theirs = index["tokenizer"]
    ours = tokenizer_identity(tokenizer, getattr(tokenizer, "path", None) or "byte")
    if any(ours[k] != theirs[k] for k in ("fingerprint", "vocab_size", "eos_id")):
        raise UsageError(
            f"data.source={store_path!r} was tokenized with {_describe(theirs)}, but the run's "
            f"data.tokenizer is {_describe(ours)}; set --config.data.tokenizer={theirs['spec']} "
            "or tokenize the corpus again with zoo-data --tokenizer=..."
        )


# ----------------------------------------------------------------------------- records


def encode_record(ids: np.ndarray, loss_mask: np.ndarray | None = None) -> bytes:
    ids = np.asarray(ids, dtype="<i4")
    if loss_mask is None:
        return ids.tobytes()
    return ids.tobytes() + np.asarray(loss_mask, dtype=np.uint8).tobytes()


def decode_record(raw: bytes, with_mask: bool) -> tuple[np.ndarray, np.ndarray | None]:
    if not with_mask:
        return np.frombuffer(raw, dtype="<i4").astype(np.int32), None
    n = len(raw) // 5
    ids = np.frombuffer(raw, dtype="<i4", count=n).astype(np.int32)
    return ids, np.frombuffer(raw, dtype=np.uint8, offset=4 * n).astype(np.int32)


class ShardWriter:
    """Writes shard `i` of a store under temporary names; `close()` renames the finished
    ArrayRecord and lengths into place, so a shard file under its own name is complete."""

    def __init__(self, directory: str, i: int):
        from array_record.python.array_record_module import ArrayRecordWriter

        self.directory, self.i = directory, i
        self._tmp = os.path.join(directory, f".tmp-{shard_name(i)}")
        self._writer = ArrayRecordWriter(self._tmp, "group_size:1")
        self.lengths: list[int] = []

    def write(self, ids, loss_mask=None) -> None:
        self._writer.write(encode_record(ids, loss_mask))
        self.lengths.append(len(ids))

    def close(self) -> dict:
        self._writer.close()
        os.replace(self._tmp, os.path.join(self.directory, shard_name(self.i)))
        from nnx_zoo.runtime.files import atomic_write

        lengths = np.asarray(self.lengths, dtype=np.int32)
        atomic_write(
            os.path.join(self.directory, lengths_name(self.i)), lambda f: np.save(f, lengths)
        )
        return {
            "file": shard_name(self.i),
            "lengths": lengths_name(self.i),
            "documents": len(lengths),
            "tokens": int(lengths.sum(dtype=np.int64)),
        }

    def abort(self) -> None:
        self._writer.close()
        if os.path.exists(self._tmp):
            os.remove(self._tmp)


def write_index(directory: str, index: dict) -> None:
    from nnx_zoo.runtime.files import write_json_atomic

    write_json_atomic(os.path.join(directory, INDEX), index)


# ----------------------------------------------------------------------------- reading


def read_index(path: str) -> dict:
    path = _local(path)
    index_path = storage.join(path, INDEX)
    try:
        index = json.loads(storage.read_bytes(index_path))
    except (OSError, ValueError) as e:
        raise UsageError(f"{index_path}: not a readable token-store index ({e})") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise UsageError(f"{index_path}: not a {FORMAT} index")
    if index.get("version") != VERSION:
        raise UsageError(
            f"{index_path}: store version {index.get('version')}; this version reads {VERSION}"
        )
    return index


def _load_npy(path: str) -> np.ndarray:
    if storage.is_url(path):
        return np.load(io.BytesIO(storage.read_bytes(path)))
    return np.load(path)


class TokenStore:
    """A store's documents by number: lengths in memory (4 bytes each), records read on demand.
    Pickles without its open files (Grain's worker processes reopen them)."""

    def __init__(self, path: str):
        self.path = _local(path)
        self.index = read_index(self.path)
        self.with_mask = self.index["data_format"] != "text"
        shards = self.index["shards"]
        self.lengths = (
            np.concatenate([_load_npy(storage.join(self.path, s["lengths"])) for s in shards])
            if shards
            else np.zeros(0, np.int32)
        ).astype(np.int64)
        counts = np.array([s["documents"] for s in shards], dtype=np.int64)
        if int(counts.sum()) != len(self.lengths) or len(self.lengths) != self.index["documents"]:
            raise UsageError(f"{self.path}: the shards' lengths do not match index.json")
        self.shard_starts = np.concatenate([[0], np.cumsum(counts)])  # first document of each
        self._readers: dict[int, object] = {}
        self._opening = threading.Lock()

    def __len__(self) -> int:
        return len(self.lengths)

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k not in ("_readers", "_opening")}

    def __setstate__(self, state):
        self.__dict__.update(state, _readers={}, _opening=threading.Lock())

    def _reader(self, shard: int):
        reader = self._readers.get(shard)
        if reader is None:
            # Grain's read threads ask at once; each shard's chunk index is read once.
            with self._opening:
                reader = self._readers.get(shard)
                if reader is None:
                    from array_record.python.array_record_module import ArrayRecordReader

                    file = storage.join(self.path, self.index["shards"][shard]["file"])
                    if storage.is_url(file):
                        # ArrayRecord's reader opens local files only: the shard, copied once.
                        file = storage.local_copy(file)
                    reader = self._readers[shard] = ArrayRecordReader(file, _READ_OPTIONS)
        return reader

    def read(self, documents) -> list[tuple[np.ndarray, np.ndarray | None]]:
        """(ids, loss mask or None) of each document number in `documents`, in that order;
        each shard's records are read in one call."""
        documents = np.asarray(documents, dtype=np.int64)
        shards = np.searchsorted(self.shard_starts, documents, side="right") - 1
        out: list = [None] * len(documents)
        for shard in np.unique(shards):
            where = np.flatnonzero(shards == shard)
            local = (documents[where] - self.shard_starts[shard]).tolist()
            for at, raw in zip(where, self._reader(int(shard)).read(local), strict=True):
                out[at] = decode_record(raw, self.with_mask)
        return out

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()
        self._readers = {}
