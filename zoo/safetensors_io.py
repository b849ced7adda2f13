"""Hugging Face checkpoint files: safetensors read one tensor at a time, and written in
shards (with an index when there are several). Knows nothing of models or names.

safetensors' numpy reader rejects BF16 (numpy has no bfloat16), the dtype most hub
checkpoints use; the format is an 8-byte little-endian header length, a JSON header and raw
little-endian bytes, read here directly. Every malformed file is a one-line UsageError naming
the file (and the tensor, where there is one).
"""

from __future__ import annotations

import json
import math
import os
import struct

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from nnx_zoo.errors import UsageError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30  # Hugging Face's default shard size

_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    # The hub's FP8 checkpoints (read dequantized: zoo/hf_dequantize.py).
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
_LENGTH_BYTES = 8


class SafetensorsFile:
    """Names, shapes and dtypes from the header; `read(name)` reads that tensor's bytes only."""

    def __init__(self, path: str):
        self.path = path
        size = os.path.getsize(path)
        if size < _LENGTH_BYTES:
            raise UsageError(
                f"{path}: {size} bytes is too short for a safetensors file (an 8-byte header "
                "length, a JSON header, then the tensor data)"
            )
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(_LENGTH_BYTES))
            # Checked before reading: a corrupt length would otherwise ask for exabytes.
            if header_len > size - _LENGTH_BYTES:
                raise UsageError(
                    f"{path}: header length {header_len} is larger than the file ({size} "
                    "bytes); the file is truncated or not a safetensors file"
                )
            raw = f.read(header_len)
        try:
            header = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UsageError(f"{path}: the safetensors header is not JSON ({e})") from None
        if not isinstance(header, dict):
            raise UsageError(f"{path}: the safetensors header is not a JSON object")
        header.pop("__metadata__", None)
        self._data_start = _LENGTH_BYTES + header_len
        self._entries = header
        for name in header:
            self._check_entry(name, size - self._data_start)

    def _check_entry(self, name: str, data_bytes: int) -> None:
        entry = self._entries[name]
        try:
            dtype, shape, (start, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise UsageError(
                f"{self.path}: tensor {name}'s header entry is malformed (expected dtype, "
                "shape and data_offsets)"
            ) from None
        # A dtype we cannot read is an error only when the tensor is read (it may be unused).
        want = math.prod(shape) * np.dtype(_DTYPES[dtype]).itemsize if dtype in _DTYPES else None
        if want is not None and end - start != want:
            raise UsageError(
                f"{self.path}: tensor {name} of shape {tuple(shape)} and dtype {dtype} needs "
                f"{want} bytes, its header gives {end - start}"
            )
        if end > data_bytes:
            raise UsageError(
                f"{self.path}: tensor {name} ends at data byte {end}, past the file's "
                f"{data_bytes} bytes of data; the file is truncated"
            )

    def names(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entries[name]["shape"])

    def dtype(self, name: str) -> str:
        return self._entries[name]["dtype"]

    def read(self, name: str) -> np.ndarray:
        entry = self._entries[name]
        if entry["dtype"] not in _DTYPES:
            raise UsageError(
                f"{self.path}: tensor {name} has dtype {entry['dtype']}; supported: "
                f"{', '.join(_DTYPES)}"
            )
        start, end = entry["data_offsets"]
        with open(self.path, "rb") as f:
            f.seek(self._data_start + start)
            data = f.read(end - start)
        if len(data) != end - start:  # shrunk since the header was checked
            raise UsageError(
                f"{self.path}: tensor {name} is truncated ({len(data)} of {end - start} bytes)"
            )
        return np.frombuffer(data, _DTYPES[entry["dtype"]]).reshape(entry["shape"])


class CheckpointReader:
    """Every tensor of a checkpoint directory, single-file or sharded with an index."""

    def __init__(self, directory: str):
        self.directory = str(directory)
        index_path = os.path.join(directory, INDEX_FILE)
        single_path = os.path.join(directory, SINGLE_FILE)
        if os.path.exists(index_path):
            weight_map = _weight_map(index_path)
            files = {}
            for shard in sorted(set(weight_map.values())):
                shard_path = os.path.join(directory, shard)
                if not os.path.exists(shard_path):
                    raise UsageError(f"{index_path}: lists {shard}, which does not exist")
                files[shard] = SafetensorsFile(shard_path)
            self._file_of = {}
            for name, shard in weight_map.items():
                if name not in files[shard].names():
                    raise UsageError(f"{index_path}: places {name} in {shard}, which lacks it")
                self._file_of[name] = files[shard]
        elif os.path.exists(single_path):
            single = SafetensorsFile(single_path)
            self._file_of = dict.fromkeys(single.names(), single)
        else:
            raise UsageError(f"{directory}: no {SINGLE_FILE} or {INDEX_FILE}")

    def __str__(self) -> str:
        return self.directory

    def names(self) -> list[str]:
        return list(self._file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._file_of[name].shape(name)

    def dtype(self, name: str) -> str:
        return self._file_of[name].dtype(name)

    def read(self, name: str) -> np.ndarray:
        return self._file_of[name].read(name)


def _weight_map(index_path: str) -> dict[str, str]:
    try:
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise UsageError(f"{index_path}: not a safetensors index ({type(e).__name__})") from None
    if not isinstance(weight_map, dict):
        raise UsageError(f"{index_path}: weight_map is not a JSON object")
    return weight_map


class ShardWriter:
    """Adds tensors in order; writes a shard whenever the next one would pass the limit."""

    def __init__(self, directory: str, max_shard_bytes: int):
        self.directory = directory
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, np.ndarray] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []
        self.total_bytes = 0

    def add(self, name: str, array: np.ndarray) -> None:
        if self._pending and self._pending_bytes + array.nbytes > self.max_shard_bytes:
            self._flush()
        self._pending[name] = np.ascontiguousarray(array)
        self._pending_bytes += array.nbytes
        self.total_bytes += array.nbytes

    def _flush(self) -> None:
        path = os.path.join(self.directory, f"shard-{len(self._shards)}.tmp")
        # 'pt' is what transformers' loader expects in the metadata of a safetensors file.
        save_file(self._pending, path, metadata={"format": "pt"})
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def finish(self) -> None:
        if self._pending or not self._shards:
            self._flush()
        n = len(self._shards)
        if n == 1:
            os.rename(
                os.path.join(self.directory, "shard-0.tmp"),
                os.path.join(self.directory, SINGLE_FILE),
            )
            return
        weight_map = {}
        for k, names in enumerate(self._shards):
            shard = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
            os.rename(
                os.path.join(self.directory, f"shard-{k}.tmp"), os.path.join(self.directory, shard)
            )
            weight_map.update(dict.fromkeys(names, shard))
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        with open(os.path.join(self.directory, INDEX_FILE), "w") as f:
            json.dump(index, f, indent=2)
