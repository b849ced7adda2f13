"""The pipeline schedules by name, and the check of a `pipeline_schedule` against
`pipeline_repeats` (imported by the config, so it imports nothing of the model)."""

from __future__ import annotations

from nnx_zoo.errors import UsageError

# "auto" is "gpipe" for pipeline_repeats 1 and "circular" above (what pipeline_repeats alone
# chose before the schedule had a name).
SCHEDULES = ("auto", "gpipe", "circular", "1f1b")


def resolve_schedule(schedule: str, repeats: int) -> str:
    """`pipeline_schedule` checked against `pipeline_repeats` ("auto": gpipe for 1, circular
    for more), or UsageError with one line saying what would be valid."""
    if schedule not in SCHEDULES:
        raise UsageError(f"pipeline_schedule={schedule!r}; valid: {', '.join(SCHEDULES)}")
    if schedule == "auto":
        return "gpipe" if repeats == 1 else "circular"
    if schedule == "circular" and repeats < 2:
        raise UsageError(
            f"pipeline_schedule='circular' with pipeline_repeats={repeats}; the circular "
            "schedule needs pipeline_repeats >= 2 (with 1 it is gpipe)"
        )
    if schedule in ("gpipe", "1f1b") and repeats != 1:
        raise UsageError(
            f"pipeline_schedule={schedule!r} with pipeline_repeats={repeats}; {schedule} runs "
            "one layer chunk per stage: set pipeline_repeats=1, or use "
            "pipeline_schedule=circular for repeats > 1 (interleaved 1F1B is not built)"
        )
    return schedule
