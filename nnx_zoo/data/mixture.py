"""Weighted mixtures: several sources in one stream of global batches, each packed row taken
whole from one source (`data.mixture`, docs/data.md#weighted-mixtures).

Each source is its own pipeline up to packed rows (nnx_zoo/data/pipeline.py's `packed_rows`:
documents, tokenize, chunk, pack, seeded by the run's seed and the source's name; for a text
token store, its concat-then-split rows, nnx_zoo/data/rows.py's `store_rows`), so a row
never mixes sources and the loss of a source's documents is what it would be alone. The rows
are then interleaved by weight: global row k of the stream comes from the source `_Schedule`
names, a closed form of k and the weights (the hierarchical split Grain's `MapDataset.mix`
uses, here over weights resolved to 2**-20): after any m rows each source has given its
weight's share of them to within K rows (K sources; one row for two), so every global batch
holds each source's share of rows, and the schedule needs no state but the row count.
Batches carry `source_ids` [B] (int32, the source's index in the mixture) beside `tokens`,
`segment_ids` and `positions`; the training loop counts tokens per source from it and strips
it before the step.

A source is either a stream (an IterDataset of packed rows, as `packed_rows` makes from text
files, ArrayRecord files and chat stores: every process reads all of it, as a single source
is read, and keeps its rows [p*B/n, (p+1)*B/n) of each global batch) or a random-access
MapDataset of rows (a text token store): then a process reads only its own rows, row k being
the source's row `index` of the schedule, so the mixture keeps each process's share of the
reading. A random-access source's position is its row count, which the schedule gives.

The iterator's state is one global fact, the same on every process and for any number of
processes and workers: the global rows emitted, the weights and where they took effect, and
each streamed source's position in its global form (nnx_zoo/data/position.py). It resumes
exactly; with other weights (a run resumed with a changed `data.mixture` weight), each source
continues where it was and the new weights' schedule starts at the resume point, so the rows
after it hold the new shares (to within K rows, as from the start); a state with other source names
is a UsageError naming both.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Sequence
from typing import Any

import grain
import jax
import numpy as np

from nnx_zoo.data import position, token_store
from nnx_zoo.data.pipeline import check_batch_split, check_store, packed_rows
from nnx_zoo.data.rows import store_rows
from nnx_zoo.data.sources import DEFAULT_VALIDATION_FRACTION, NoValidationSplitError
from nnx_zoo.data.tokenizers import Tokenizer
from nnx_zoo.errors import UsageError

# The batch key of each row's source index; the training loop strips it before the step
# (nnx_zoo/training/loop.py's SOURCE_IDS).
SOURCE_IDS = "source_ids"
_RESOLUTION = 1 << 20  # weights become integer proportions summing to about this


def proportions(weights: Sequence[float]) -> tuple[int, ...]:
    """Integer proportions for `weights` (each > 0), to 2**-20 of the total."""
    total = sum(weights)
    return tuple(max(1, round(w / total * _RESOLUTION)) for w in weights)


def rows_before(m: int, props: Sequence[int]) -> list[int]:
    """Rows of each source among the first m rows of the interleave: source i takes its
    share of what the sources before it left (rounded up), so the counts sum to m, each grows
    by 0 or 1 from m to m + 1, and source i's is within i + 1 rows of m * its proportion
    (each level's rounding adds less than one)."""
    remaining, left, counts = sum(props), m, []
    for p in props:
        later = left * (remaining - p) // remaining
        counts.append(left - later)
        remaining, left = remaining - p, later
    return counts


def source_of_row(k: int, props: Sequence[int]) -> tuple[int, int]:
    """(source, its row index) of row k of the interleave: the one source whose count grows."""
    before, after = rows_before(k, props), rows_before(k + 1, props)
    source = next(i for i, (b, a) in enumerate(zip(before, after, strict=True)) if a != b)
    return source, before[source]


@dataclasses.dataclass(frozen=True)
class _Schedule:
    """Global row k >= start comes from the interleave of `props` at k - start; each source's
    rows are numbered on from `offsets` (its rows read before `start`)."""

    props: tuple[int, ...]
    start: int = 0
    offsets: tuple[int, ...] | None = None

    def row(self, k: int) -> tuple[int, int]:
        source, index = source_of_row(k - self.start, self.props)
        return source, index + (self.offsets[source] if self.offsets else 0)

    def rows_read(self, k: int) -> list[int]:
        counts = rows_before(k - self.start, self.props)
        return [c + o for c, o in zip(counts, self.offsets or [0] * len(counts), strict=True)]


@dataclasses.dataclass(frozen=True)
class MixtureSource:
    """One source of a mixture: its rows (dicts of [T] int32 arrays), as a stream
    (`packed_rows`'s IterDataset, read by every process) or a random-access MapDataset (each
    process reads its own rows); `num_workers` of a stream, for its global position."""

    name: str
    weight: float
    rows: grain.IterDataset | grain.MapDataset
    num_workers: int = 0

    @property
    def streamed(self) -> bool:
        return not isinstance(self.rows, grain.MapDataset)


class _MixtureIterator(grain.DatasetIterator):
    def __init__(self, sources, batch_size, process_index, process_count, num_batches):
        self._sources = sources
        self._iterators = [iter(s.rows) if s.streamed else None for s in sources]
        super().__init__([it for it in self._iterators if it is not None])
        self._names = [s.name for s in sources]
        total = sum(s.weight for s in sources)
        # Saved as they are and resolved to proportions the same way on resume, so the same
        # weights always give the same schedule.
        self._weights = [s.weight / total for s in sources]
        self._props = proportions(self._weights)
        self._schedule = _Schedule(self._props)
        self._batch_size, self._num_batches = batch_size, num_batches
        rows = batch_size // process_count
        self._own = (process_index * rows, (process_index + 1) * rows)
        self._rows = 0  # global rows emitted, over all processes
        # The row at which weights other than the saved position's took effect (None: none).
        self.reweighted_at: int | None = None

    def __next__(self) -> dict[str, np.ndarray]:
        if self._num_batches is not None and self._rows >= self._num_batches * self._batch_size:
            raise StopIteration
        first, last = (self._rows + r for r in self._own)
        rows, ids = [], []
        for k in range(self._rows, self._rows + self._batch_size):
            source, index = self._schedule.row(k)
            mine = first <= k < last
            iterator = self._iterators[source]
            if iterator is not None:
                row = next(iterator)  # every process reads a stream whole, in order
            elif mine:
                row = self._sources[source].rows[index]
            if mine:
                rows.append(row)
                ids.append(source)
        self._rows += self._batch_size
        batch = {key: np.stack([row[key] for row in rows]) for key in rows[0]}
        batch[SOURCE_IDS] = np.asarray(ids, dtype=np.int32)
        return batch

    def get_state(self) -> dict[str, Any]:
        return {
            "rows": self._rows,
            "weights": dict(zip(self._names, self._weights, strict=True)),
            "schedule_start": self._schedule.start,
            "rows_read_at_start": dict(
                zip(self._names, self._schedule.rows_read(self._schedule.start), strict=True)
            ),
            "streams": {
                name: position.to_global(it.get_state())
                for name, it in zip(self._names, self._iterators, strict=True)
                if it is not None
            },
        }

    def set_state(self, state: dict[str, Any]) -> None:
        saved, ours = list(state["weights"]), self._names
        if sorted(saved) != sorted(ours):
            raise UsageError(
                f"the saved data position mixes the sources {sorted(saved)}, this stream "
                f"{sorted(ours)}: a position resumes only into the same sources"
            )
        streamed = {s.name for s in self._sources if s.streamed}
        if set(state["streams"]) != streamed:  # a source now a stream and then rows, or back
            raise UsageError(
                f"the saved data position reads the sources {sorted(state['streams'])} as "
                f"streams, this stream {sorted(streamed)} (the rest row by row): it was "
                "written by another version of the mixture"
            )
        for source, iterator in zip(self._sources, self._iterators, strict=True):
            if iterator is not None:
                saved_stream = state["streams"][source.name]
                iterator.set_state(position.for_workers(saved_stream, source.num_workers))
        rows = int(state["rows"])
        saved_schedule = _Schedule(
            proportions([state["weights"][n] for n in ours]),
            int(state["schedule_start"]),
            tuple(int(state["rows_read_at_start"][n]) for n in ours),
        )
        if saved_schedule.props == self._props:
            self._schedule, self.reweighted_at = saved_schedule, None
        else:  # each source goes on from its rows read; the new weights from here on
            self._schedule = _Schedule(self._props, rows, tuple(saved_schedule.rows_read(rows)))
            self.reweighted_at = rows
        self._rows = rows


class Mixture(grain.IterDataset):
    """The global batches of `sources` mixed by weight; this process's rows of each (module
    docstring). `num_batches`: stop after that many (validation)."""

    def __init__(
        self,
        sources: Sequence[MixtureSource],
        global_batch_size: int,
        *,
        process_index: int | None = None,
        process_count: int | None = None,
        num_batches: int | None = None,
    ):
        parents = [s.rows for s in sources if s.streamed]
        super().__init__(parents)
        if not sources:
            raise UsageError("a mixture needs at least one source")
        if not all(math.isfinite(s.weight) and s.weight > 0 for s in sources):
            raise UsageError(f"mixture weights must be finite and > 0: {sources}")
        self._sources = list(sources)
        self._process_index = jax.process_index() if process_index is None else process_index
        self._process_count = jax.process_count() if process_count is None else process_count
        check_batch_split(global_batch_size, self._process_count)
        self._batch_size, self._num_batches = global_batch_size, num_batches

    def __iter__(self) -> _MixtureIterator:
        return _MixtureIterator(
            self._sources,
            self._batch_size,
            self._process_index,
            self._process_count,
            self._num_batches,
        )


def source_seed(seed: int, name: str) -> int:
    """A source's shuffle seed: the run's seed and the source's name, so two sources (or the
    same files under two names) are not shuffled alike, and reordering the mixture's
    components changes no source's stream."""
    return zlib.crc32(f"{seed}:{name}".encode()) & 0x7FFFFFFF


def build_mixture(
    components: Sequence[tuple[str, str, float]],
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
    num_batches: int | None = None,
    num_packing_bins: int | None = None,
    notes: list[str] | None = None,
    **row_options,
) -> Mixture:
    """The mixture of `components` ((name, source, weight) triples: data.mixture parsed) in
    `split`, each source packed on its own (`packed_rows`, with `row_options`: text_field,
    validation_fraction, shuffle_window, data_format, chat_template, chat_overflow) and read
    over and over (every source repeats); a text token store gives its rows by number
    (`store_rows`: shuffled, the last partial row dropped; unshuffled, every token, the last
    row padded), so each process reads only its own. Shuffled by default for 'train'. In
    'validation', a
    source too small to hold a validation split is left out with a note; with none left,
    NoValidationSplitError. `num_workers` worker processes per source."""
    shuffle = split == "train" if shuffle is None else shuffle
    sources = []
    for name, source, weight in components:
        try:
            if _text_store(source, tokenizer, row_options.get("data_format", "text")):
                rows = _store_rows(
                    source, split, seq_len, source_seed(seed, name), shuffle, **row_options
                )
            else:
                rows, _ = packed_rows(
                    source,
                    split,
                    tokenizer,
                    seq_len,
                    source_seed(seed, name),
                    num_workers=num_workers,
                    shuffle=shuffle,
                    repeat=True,
                    num_packing_bins=num_packing_bins or max(global_batch_size, 16),
                    notes=notes,
                    **row_options,
                )
        except NoValidationSplitError as e:
            if notes is not None:
                notes.append(f"data.mixture source {name!r}: {e}; it is left out of val_loss")
            continue
        except (ValueError, FileNotFoundError) as e:
            raise type(e)(f"data.mixture source {name!r}: {e}") from None
        sources.append(MixtureSource(name, weight, rows, num_workers))
    if not sources:
        raise NoValidationSplitError(
            "no data.mixture source has a validation split (each is one document)"
        )
    return Mixture(
        sources,
        global_batch_size,
        process_index=process_index,
        process_count=process_count,
        num_batches=num_batches,
    )


def _text_store(source: str, tokenizer: Tokenizer, data_format: str) -> bool:
    """Whether `source` is a token store of text, read by row; any store must match the
    run's tokenizer and data.format (UsageError naming both)."""
    if not token_store.is_store(source):
        return False
    check_store(source, tokenizer, data_format)
    return data_format == "text"


def _store_rows(source, split, seq_len, seed, shuffle, **row_options) -> grain.MapDataset:
    """A text store's rows (nnx_zoo/data/rows.py), repeated: shuffled, each epoch anew, with
    the last partial row dropped (a training stream); in order, the last row padded, so that
    evaluation sees every token of the split."""
    fraction = row_options.get("validation_fraction", DEFAULT_VALIDATION_FRACTION)
    if shuffle:
        return store_rows(source, split, seq_len, seed=seed, validation_fraction=fraction)
    one_pass = store_rows(
        source, split, seq_len, shuffle=False, repeat=False, validation_fraction=fraction
    )
    return one_pass.repeat(None)


def make_mixture(*args, **kwargs) -> _MixtureIterator:
    """`iter(build_mixture(...))`, with exactly its arguments."""
    return iter(build_mixture(*args, **kwargs))
