"""Per-file checksums of a checkpoint directory: written once it is complete, checked before
it is read.

`write_manifest(dir)` records the size and CRC-32 of every file under `dir` in
`dir/checksums.json` (written atomically, so its presence means the whole record is there);
`verify(dir, items)` re-reads the files under the given top-level folders and returns the
first difference as one line, or None. CRC-32 catches the accidents that damage checkpoints
(bit flips, overwritten or truncated blocks, a copy cut short); it is not a defence against
tampering. zlib computes it at well over 1 GB/s and releases the GIL, so a background thread
can checksum a save while training goes on. On an object store the manifest is one object
written whole after every file it lists, so its presence means the same there
(nnx_zoo/runtime/storage.py).
"""

from __future__ import annotations

import json
import zlib

from nnx_zoo.runtime import storage
from nnx_zoo.runtime.files import write_json_atomic

MANIFEST = "checksums.json"
_CHUNK = 16 * 2**20


def file_crc32(path: str) -> int:
    crc = 0
    with storage.open_read(path) as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _files(directory: str) -> list[str]:
    """Paths relative to `directory`, sorted; the manifest itself left out."""
    return [rel for rel in storage.walk_files(directory) if rel != MANIFEST]


def write_manifest(directory: str) -> dict:
    """Checksum every file under `directory` and write the manifest; returns it."""
    files = {}
    for rel in _files(directory):
        path = storage.join(directory, rel)
        files[rel] = {"size": storage.size(path), "crc32": file_crc32(path)}
    manifest = {"algorithm": "crc32", "files": files}
    write_json_atomic(storage.join(directory, MANIFEST), manifest)
    return manifest


def read_manifest(directory: str) -> dict | None:
    """The manifest of `directory`, or None when it is missing, unreadable or malformed."""
    try:
        manifest = json.loads(storage.read_bytes(storage.join(directory, MANIFEST)))
    except (OSError, ValueError):
        return None
    # A damaged manifest is no manifest: every entry must be {"size": int, "crc32": int}.
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or manifest.get("algorithm", "crc32") != "crc32":
        return None
    for rel, want in files.items():
        fields = want.values() if isinstance(want, dict) else ()
        if (
            not isinstance(rel, str)
            or not isinstance(want, dict)
            or set(want) != {"size", "crc32"}
            or any(type(v) is not int for v in fields)
            or ".." in rel.split("/")  # a manifest names files inside its own directory
        ):
            return None
    return manifest


def verify(directory: str, items: tuple[str, ...] | None = None) -> str | None:
    """The first file under `directory` (only under the folders `items`, when given) whose
    size or CRC-32 differs from the manifest, or that is missing, as one line; None if all
    match."""
    manifest = read_manifest(directory)
    if manifest is None:
        return f"no readable {MANIFEST}"
    for rel, want in sorted(manifest["files"].items()):
        if items is not None and rel.split("/", 1)[0] not in items:
            continue
        path = storage.join(directory, rel)
        if not storage.isfile(path):
            return f"{rel} is missing"
        size = storage.size(path)
        if size != want["size"]:
            return f"{rel} has {size} bytes, {want['size']} were written"
        if file_crc32(path) != want["crc32"]:
            return f"{rel} does not match its checksum"
    return None
