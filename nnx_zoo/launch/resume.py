"""What a resumed run keeps from the run that wrote its checkpoint, and what it may change.

- The learning-rate schedule. A resumed run keeps the checkpoint's warmup (the one its steps
  had; a smoke run's warmup was cut to fit its few steps) and takes everything else from its
  own config: its length (`training.steps`, or `optimizer.decay_steps` when set), kind, peak,
  end rate and decay. So rerunning a workdir with more `training.steps` continues on the
  schedule of the new length at the restored step: WSD's stable phase goes on and its decay
  moves to the new end; cosine is recomputed for the new length (the rate at the restored
  step moves up the new, longer curve); constant is unchanged. `keep_schedule` makes that
  choice and says it, in one line, whenever the schedule differs from the checkpoint's.
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
import functools
from collections.abc import Callable

from nnx_zoo.checkpoint.restore import read_meta
from nnx_zoo.checkpoint.steps import CorruptCheckpointError, checkpoint_dir, complete_steps
from nnx_zoo.errors import UsageError
from nnx_zoo.training.config import RunConfig, fit_warmup
from nnx_zoo.training.mixture_spec import describe_change
from nnx_zoo.training.schedules import describe, make_schedule

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


def keep_schedule(
    run: RunConfig, saved: RunConfig
) -> tuple[RunConfig, Callable[[int], str | None]]:
    """`run` with the checkpoint's warmup (cut to fit `run`'s schedule if it must), and the
    function that gives the line to print for the step resumed from (None: nothing changed)."""
    config_warmup = run.optimizer.warmup_steps
    optimizer = dataclasses.replace(run.optimizer, warmup_steps=saved.optimizer.warmup_steps)
    optimizer, _ = fit_warmup(optimizer, run.decay_steps)  # the line below names the warmup
    kept = dataclasses.replace(run, optimizer=optimizer)
    return kept, functools.partial(schedule_note, kept, saved, config_warmup)


def schedule_note(run: RunConfig, saved: RunConfig, config_warmup: int, step: int) -> str | None:
    """The one line a run resumed at `step` prints when its schedule is not the checkpoint's
    (or its warmup not the config's): both schedules and the next step's rate under each."""
    new, old = run.schedule_args(), saved.schedule_args()
    warmup = run.optimizer.warmup_steps
    if new == old and warmup == config_warmup:
        return None
    line = f"resuming at step {step} of {run.training.steps}"
    if new != old:
        rate, was = float(make_schedule(**new)(step)), float(make_schedule(**old)(step))
        line += (
            f" (the checkpoint's run had {saved.training.steps}): learning-rate schedule "
            f"{describe(**new)}, recomputed from the checkpoint's {describe(**old)}; step "
            f"{step + 1}'s rate is {rate:.3g} (the checkpoint's schedule: {was:.3g})"
        )
    if warmup != config_warmup:
        had = saved.optimizer.warmup_steps
        kept = f"{warmup} steps" if warmup == had else f"{had} steps, cut to {warmup} to fit"
        line += f"; the warmup stays the checkpoint's {kept}, not the config's {config_warmup}"
    return line


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
