"""The run's data: the tokenizer, the train stream and the validation batches, as global
arrays in the run's batch layout."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

from nnx_zoo import data
from nnx_zoo.data.tokenizers import make_tokenizer
from nnx_zoo.runtime.distributed import to_global
from nnx_zoo.training import finetune
from nnx_zoo.training.config import RunConfig


@dataclasses.dataclass
class RunData:
    tokenizer: object
    train_iter: object  # the Grain iterator, whose state checkpoints save
    train_batches: Iterator[dict]  # global arrays
    # A fresh pass over the validation batches; None for a one-document source (no split).
    make_val_batches: Callable[[], Iterator[dict]] | None
    notes: list[str] = dataclasses.field(default_factory=list)  # printed when training starts
    # data.mixture's source names, in the order of the batches' `source_ids`; () without one.
    source_names: tuple[str, ...] = ()

    def close(self) -> None:
        # Worker processes (data.num_workers > 0) hold shared memory until closed.
        self.train_iter.close()


def build_data(run: RunConfig, mesh, batch_spec) -> RunData:
    """Raises UsageError (one line) for a source or tokenizer that cannot
    serve the run; the validation split is built here so an empty one fails before training."""
    d = run.data
    tokenizer = make_tokenizer(d.tokenizer)
    common = dict(
        data_format=d.format,
        chat_template=finetune.chat_template(run, d.tokenizer),
        tokenizer=tokenizer,
        seq_len=d.seq_len,
        global_batch_size=d.global_batch_size,
        seed=d.shuffle_seed,
        text_field=d.text_field,
        validation_fraction=d.validation_fraction,
        chat_overflow=d.chat_overflow,
    )
    notes = []
    # A separate held-out source is validated on whole, and the training source(s) all trained.
    train_split, val_split = "train", "validation"
    if d.validation_source:
        train_split, val_split = "all", "all"
    components = d.mixture_components()
    train_common = dict(common, split=train_split, num_workers=d.num_workers, notes=notes)
    # Shuffled (and repeated): also for split 'all', which alone would be read in order.
    if components:
        train_iter = data.make_mixture(components=components, shuffle=True, **train_common)
    else:
        train_iter = data.make_dataset(source=d.source, shuffle=True, repeat=True, **train_common)
    val_common = dict(common, split=val_split, num_batches=run.training.eval_batches, notes=notes)
    try:
        if d.validation_source:
            val_dataset = data.build_dataset(source=d.validation_source, **val_common)
        elif components:
            # The same weighted mix of the sources' validation splits (each read over and over
            # until eval_batches batches are full), so val_loss weighs them as training does.
            val_dataset = data.build_mixture(components=components, **val_common)
        else:
            val_dataset = data.build_dataset(source=d.source, **val_common)
    except data.NoValidationSplitError as e:  # one document: train on it, validate nothing
        val_dataset = None
        notes.append(f"{e}; val_loss is not computed")
    except BaseException as e:  # a held-out source that cannot serve: no worker outlives it
        train_iter.close()
        if d.validation_source and isinstance(e, FileNotFoundError | ValueError):
            raise type(e)(f"data.validation_source: {e}") from None
        raise
    return RunData(
        tokenizer=tokenizer,
        train_iter=train_iter,
        train_batches=(to_global(b, mesh, batch_spec) for b in train_iter),
        make_val_batches=None
        if val_dataset is None
        else lambda: (to_global(b, mesh, batch_spec) for b in val_dataset),
        notes=notes,
        source_names=tuple(c.name for c in components),
    )
