"""The training stream's position as one global fact: how many documents the chunker has read
and the state of the stages after it (chunking, window shuffle, packing, batching), the same
for every process count and every number of Grain worker processes.

Every process runs the same pipeline over the same documents (nnx_zoo/data/pipeline.py), so
its Grain state is the same on every process. Only the reading stage's state depends on
`num_workers`: in-process it is `{"next_index": N}`; with W workers, `mp_prefetch` reads
documents i, i+W, i+2W, ... in worker i and interleaves the workers in turn, so its state holds
each worker's count and the next worker. The global form replaces that stage's state by
`{"documents_read": N}`; `to_global` and `for_workers` convert both ways. A state saved by a
run with one worker count thus resumes in a run with another.

This reads Grain's state layout (grain 0.2.x: flat map, window shuffle, first-fit packing and
interleave states); a layout this module does not know raises UsageError naming the key,
rather than resuming somewhere else. tests/test_elastic_data.py checks the round trips.
"""

from __future__ import annotations

import copy
from typing import Any

import grain

from nnx_zoo.errors import UsageError

DOCUMENTS_READ = "documents_read"
# Keys under which a Grain stage keeps its parent's state: most stages, the window shuffle
# (the state at its window's start), and the flat map (the chunker), whose parent is the
# reading stage.
_PARENT_KEYS = ("parent", "parent_window_start_state")
_FLAT_MAP_KEY = "next_index_in_buffer"


def _reader_holder(state: dict[str, Any]) -> dict[str, Any]:
    """The chunker's state (a flat map's), whose 'parent' is the reading stage's state."""
    node = state
    while isinstance(node, dict) and _FLAT_MAP_KEY not in node:
        node = next((node[k] for k in _PARENT_KEYS if k in node), None)
    if not isinstance(node, dict) or not isinstance(node.get("parent"), dict):
        raise UsageError(
            f"data-iterator state has no chunker stage (a dict with {_FLAT_MAP_KEY!r}); "
            "it was not written by this pipeline"
        )
    return node


def documents_read(state: dict[str, Any]) -> int:
    """Documents the chunker has read at the position `state` holds (any form)."""
    return _reader_documents(_reader_holder(state)["parent"])


def _reader_documents(reader: dict[str, Any]) -> int:
    """Documents the reading stage has handed on, from its state in-process or with workers."""
    if DOCUMENTS_READ in reader:
        return int(reader[DOCUMENTS_READ])
    if set(reader) == {"next_index"}:
        return int(reader["next_index"])
    states = reader.get("iterators_in_use_states")
    if not isinstance(states, list) or reader.get("future_states") or any(reader["exhausted"]):
        raise UsageError(f"data-iterator reading state of an unknown layout: {sorted(reader)}")
    counts = [int(s["next_index"]) for s in states]
    total = sum(counts)
    if reader["next_index_in_cycle"] != total % len(counts) or counts != _split(total, len(counts)):
        raise UsageError(f"data-iterator worker counts {counts} are not a round-robin position")
    return total


def _split(total: int, workers: int) -> list[int]:
    """Documents each worker has read after `total` in turn: worker i reads i, i+W, ..."""
    return [total // workers + (i < total % workers) for i in range(workers)]


def _reader_state(total: int, num_workers: int) -> dict[str, Any]:
    if num_workers == 0:
        return {"next_index": total}
    return {
        "next_index_in_cycle": total % num_workers,
        "next_index_in_datasets": num_workers,
        "iterators_in_use_indices": list(range(num_workers)),
        "iterators_in_use_states": [{"next_index": n} for n in _split(total, num_workers)],
        "exhausted": [0] * num_workers,
        "future_states": {},
    }


def reader_documents(reader: dict[str, Any]) -> int:
    """Elements a reading stage (a MapDataset read in order, in-process or by workers) has
    handed on, from its Grain state; the token-store batches (data/rows.py) count batches so."""
    return _reader_documents(reader)


def reader_state(total: int, num_workers: int) -> dict[str, Any]:
    """The Grain state of a reading stage with `num_workers` that has handed on `total`."""
    return _reader_state(total, num_workers)


def to_global(state: dict[str, Any]) -> dict[str, Any]:
    """The global form of a pipeline state (any worker count; already global is kept)."""
    state = copy.deepcopy(state)
    holder = _reader_holder(state)
    holder["parent"] = {DOCUMENTS_READ: _reader_documents(holder["parent"])}
    return state


def for_workers(state: dict[str, Any], num_workers: int) -> dict[str, Any]:
    """The Grain state of a pipeline with `num_workers` at the position `state` holds (global,
    or a raw state of any worker count)."""
    state = copy.deepcopy(state)
    holder = _reader_holder(state)
    holder["parent"] = _reader_state(_reader_documents(holder["parent"]), num_workers)
    return state


class _GlobalPositionIterator(grain.DatasetIterator):
    def __init__(self, parent, num_workers: int):
        super().__init__(parent)
        self._num_workers = num_workers

    def __next__(self):
        return next(self._parent)

    def get_state(self) -> dict[str, Any]:
        return to_global(self._parent.get_state())

    def set_state(self, state: dict[str, Any]) -> None:
        self._parent.set_state(for_workers(state, self._num_workers))


class GlobalPosition(grain.IterDataset):
    """`parent`'s elements; its iterator's state is the global form (module docstring)."""

    def __init__(self, parent, num_workers: int):
        super().__init__(parent)
        self._num_workers = num_workers

    def __iter__(self) -> _GlobalPositionIterator:
        return _GlobalPositionIterator(self._parent.__iter__(), self._num_workers)
