"""The records of an offline W&B run, read back from its `run-<id>.wandb` file.

wandb (0.31) keeps no Python reader for these files (its old `wandb.sdk.internal.datastore`
is gone), so this reads the format itself: a 7-byte header (b":W&B", 0xBEE1, version 0), then
LevelDB's log format -- 32 KiB blocks of chunks, each `crc32 (4) | length (2) | type (1)` with
type FULL 1, FIRST 2, MIDDLE 3, LAST 4, and a block's last < 7 bytes zero padding -- whose
records are `wandb_internal_pb2.Record` protobufs.
"""

from __future__ import annotations

import glob
import json
import os
import struct
import time

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _chunks(path: str):
    with open(path, "rb") as f:
        data = f.read()
    ident, magic, version = struct.unpack("<4sHB", data[:HEADER])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), (ident, magic, version)
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # the block's tail: padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        if kind == 0 and length == 0:  # zeros to the end of the block
            pos += left
            continue
        if pos + HEADER + length > len(data):  # a chunk still being written
            return
        chunk = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            yield pending + chunk
            pending = b""


def records(path: str):
    from wandb.proto import wandb_internal_pb2

    for raw in _chunks(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        yield record


def offline_runs(wandb_dir: str) -> list[str]:
    """The .wandb files of the offline runs under WANDB_DIR, oldest first."""
    return sorted(glob.glob(os.path.join(wandb_dir, "wandb", "offline-run-*", "run-*.wandb")))


def read_run(path: str, timeout: float = 60.0) -> dict:
    """{"id", "project", "name", "tags", "config": {key: value}, "history": {step: {key:
    value}}} of one offline run file, once it is complete: `run.finish()` returns before
    wandb-core's writer has written the file (a file of the header alone was seen right
    after it), so this waits for the run's `exit` record."""
    deadline = time.monotonic() + timeout
    while True:
        kinds = [r.WhichOneof("record_type") for r in records(path)]
        if "exit" in kinds or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    out = {"config": {}, "history": {}}
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
            out.update(id=run.run_id, project=run.project, name=run.display_name)
            out["tags"] = list(run.tags)
            for item in run.config.update:
                out["config"][item.key] = json.loads(item.value_json)
        elif kind == "config":
            for item in record.config.update:
                out["config"][item.key] = json.loads(item.value_json)
        elif kind == "history":
            row = out["history"].setdefault(record.history.step.num, {})
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                row[key] = json.loads(item.value_json)
    return out
