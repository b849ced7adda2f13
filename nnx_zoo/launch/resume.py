"""What a resumed run keeps from the run that wrote its checkpoint, and what it may change.

- The learning-rate schedule. Its length is `optimizer.decay_steps`, which defaults to
  `training.steps`; resuming with another `steps` would silently recompute the schedule (the
  rate jumps at the restored step). So a resumed run keeps the checkpoint's schedule length
  unless `--config.optimizer.decay_steps` is given: raising `steps` then trains on at the
  schedule's final rate. `keep_schedule` makes that choice and says it.
- The data iterator. Its saved state is a position in one document stream, so it restores
  only into the same stream: same source, tokenizer, text field, validation split, shuffle
  seed, sequence length and (global) batch size. `data_changes` names the fields that differ;
  the run then starts that stream afresh from its beginning (with a warning), since the old
  position means nothing in a new stream. The number of processes and `num_workers` change
  neither the stream nor its saved position (nnx_zoo/data/position.py): they may differ freely.
- A mixture's sources (`data.mixture`'s names and sources; a run of `data.source` alone is a
  run without one). A resumed run must mix the same sources: `check_mixture` refuses another
  set in one line naming the difference, since starting every source again would train on
  their first rows twice without a word. Other weights are allowed: each source continues
  where it was and the new weights apply from the resumed step on (nnx_zoo/data/mixture.py);
  the note says so.
"""

from __future__ import annotations

import dataclasses

from nnx_zoo.checkpoint.restore import read_meta
from nnx_zoo.checkpoint.steps import CorruptCheckpointError, checkpoint_dir, complete_steps
from nnx_zoo.errors import UsageError
from nnx_zoo.training.config import RunConfig
from nnx_zoo.training.mixture_spec import describe_change

# DataSection fields that define the document stream a saved iterator position refers to
# (data.mixture: `check_mixture`).
STREAM_FIELDS = (
    "format",
    "source",
    "tokenizer",
    "text_field",
    "validation_fraction",
    "shuffle_seed",
    "seq_len",
    "global_batch_size",
)


def saved_run(workdir: str, step: int | None = None):
    """(step, RunConfig) recorded in the latest complete checkpoint (or `step`), or None when
    there is none or it records no config."""

    steps = [step] if step is not None else complete_steps(checkpoint_dir(workdir), warn=False)
    for candidate in reversed(steps):
        try:
            step, meta = read_meta(workdir, candidate)
        except CorruptCheckpointError:
            continue  # the integrity check names it when training resumes
        config = (meta.get("run_info") or {}).get("config")
        return (step, RunConfig.from_config_dict(config)) if config else None
    return None


def keep_schedule(run, saved) -> tuple[object, str | None]:
    """`run` with the saved schedule length when `run` leaves decay_steps unset and its steps
    differ; and the note to print (None when nothing changed)."""
    if run.optimizer.decay_steps is not None or saved.decay_steps == run.training.steps:
        return run, None
    optimizer = dataclasses.replace(run.optimizer, decay_steps=saved.decay_steps)
    note = (
        f"training.steps is {run.training.steps}, the checkpoint's run had "
        f"{saved.training.steps}: keeping its learning-rate schedule of {saved.decay_steps} "
        "steps (set --config.optimizer.decay_steps to choose another)"
    )
    return dataclasses.replace(run, optimizer=optimizer), note


def data_changes(run, saved) -> list[str]:
    """'field old -> new' for each stream field that differs (then the saved iterator state
    is not restored)."""
    return [
        f"data.{name} {getattr(saved.data, name)!r} -> {getattr(run.data, name)!r}"
        for name in STREAM_FIELDS
        if getattr(saved.data, name) != getattr(run.data, name)
    ]


def check_mixture(run, saved, step: int) -> str | None:
    """The note for a mixture resumed with other weights (None when they are the same); a
    UsageError naming the difference when its sources are not the checkpoint's."""
    sources, weights = describe_change(saved.data.mixture, run.data.mixture)
    if sources:
        raise UsageError(
            f"data.mixture differs from checkpoint step {step}'s in its sources ({sources}); a "
            "workdir resumes the sources it saved: give them back (only weights may change), "
            "or train the new mixture in a new --workdir"
        )
    if weights:
        return (
            f"data.mixture weights differ from checkpoint step {step}'s ({weights}): each "
            f"source continues where it was, the new weights apply from step {step} on"
        )
    return None
