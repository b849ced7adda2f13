"""nnx_zoo/training/schedules.py and the schedule fields of the config: each schedule's rate
at every step against the formulas written out by hand here (no optax), the WSD decay window,
the warmup clamp, and what a resumed run keeps (nnx_zoo/launch/resume.py's keep_schedule)."""

import math

import pytest

from nnx_zoo.errors import UsageError
from nnx_zoo.training.optim import make_optimizer
from nnx_zoo.training.schedules import decay_window, make_schedule, max_warmup

PEAK, END_RATIO = 2e-3, 0.1
END = PEAK * END_RATIO


def reference(
    kind, t, *, warmup, length, fraction=0.2, shape="linear", peak=PEAK, end_ratio=END_RATIO
):
    """The documented rate at optimizer step t (0 for the first update)."""
    PEAK, END = peak, peak * end_ratio  # noqa: N806 -- the module's names, for other peaks
    if t < warmup:
        return PEAK * t / warmup
    if kind == "constant":
        return PEAK
    if kind == "cosine":
        if t >= length:
            return END
        return END + (PEAK - END) * (1 + math.cos(math.pi * (t - warmup) / (length - warmup))) / 2
    decay = max(1, math.floor(fraction * length + 0.5))  # the last fraction, half rounds up
    start = length - decay
    if t < start:
        return PEAK
    s = min((t - start) / decay, 1.0)
    if shape == "linear":
        return PEAK + (END - PEAK) * s
    return END + (PEAK - END) * (1 - math.sqrt(s))


CASES = [
    # kind, warmup, length, fraction, shape
    ("wsd", 5, 50, 0.2, "linear"),  # decay over steps 40..50
    ("wsd", 5, 50, 0.2, "1-sqrt"),
    ("wsd", 0, 7, 0.5, "linear"),  # 3.5 -> a 4-step decay; no warmup
    ("wsd", 3, 10, 0.7, "1-sqrt"),  # no stable phase: the decay starts where warmup ends
    ("wsd", 0, 1, 0.2, "linear"),  # one step: the decay alone
    ("constant", 4, 20, 0.2, "linear"),
    ("constant", 0, 5, 0.2, "linear"),
    ("cosine", 10, 110, 0.2, "linear"),  # today's default, unchanged
]


@pytest.mark.parametrize("kind,warmup,length,fraction,shape", CASES)
def test_schedule_values_equal_the_written_formulas(kind, warmup, length, fraction, shape):
    schedule = make_schedule(
        kind,
        learning_rate=PEAK,
        warmup_steps=warmup,
        total_steps=length,
        end_learning_rate_ratio=END_RATIO,
        decay_fraction=fraction,
        decay_shape=shape,
    )
    for t in range(length + 5):  # past the end too: the end rate (or the peak) stays
        want = reference(kind, t, warmup=warmup, length=length, fraction=fraction, shape=shape)
        assert float(schedule(t)) == pytest.approx(want, rel=1e-5, abs=1e-9), (kind, t)


def test_make_optimizer_uses_the_named_schedule():
    _, schedule = make_optimizer(
        learning_rate=PEAK, warmup_steps=2, total_steps=20, schedule="wsd", decay_fraction=0.5
    )
    assert [round(float(schedule(t)) / PEAK, 4) for t in (1, 2, 9, 10, 15, 20)] == [
        0.5, 1.0, 1.0, 1.0, 0.55, 0.1,
    ]  # fmt: skip


def test_decay_window_and_the_longest_warmup():
    assert [decay_window(n, 0.2) for n in (1, 2, 10, 12, 60, 100)] == [1, 1, 2, 2, 12, 20]
    assert decay_window(10, 0.35) == 4  # 3.5 (a hair under it in floating point) rounds up
    assert decay_window(10, 1.0) == 10
    assert max_warmup("wsd", 10, 0.2) == 8
    assert max_warmup("cosine", 10, 0.2) == max_warmup("constant", 10, 0.2) == 9


def test_a_warmup_that_does_not_fit_raises():
    with pytest.raises(UsageError, match="does not fit a wsd schedule of 10 steps: use 0..8"):
        make_schedule("wsd", learning_rate=PEAK, warmup_steps=9, total_steps=10)


def _run(**optimizer):
    from configs import tiny
    from nnx_zoo.training.config import RunConfig

    config = tiny.get_config()  # its warmup is 20
    steps = optimizer.pop("steps")
    config.training.steps = steps
    config.optimizer.update(optimizer)
    notes = []
    return RunConfig.from_config_dict(config, notes), notes


def test_config_schedule_fields_and_the_smoke_run_clamp():
    run, notes = _run(steps=10, schedule="wsd")
    # A 10-step WSD run decays over its last 2 steps: the preset's warmup of 20 is cut to 8.
    assert run.optimizer.warmup_steps == 8
    assert notes == [
        "optimizer.warmup_steps=20 does not fit a schedule of 10 steps (training.steps, or "
        "optimizer.decay_steps when set): warming up for 8 steps instead (set "
        "--config.optimizer.warmup_steps to choose)"
    ]
    run, notes = _run(steps=200)
    assert (run.optimizer.schedule, run.optimizer.warmup_steps, notes) == ("cosine", 20, [])


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("schedule", "linear", "must be one of cosine, wsd, constant"),
        ("decay_fraction", 0.0, r"must be in \(0, 1\]"),
        ("decay_fraction", 1.5, r"must be in \(0, 1\]"),
        ("decay_shape", "cosine", "must be linear or 1-sqrt"),
    ],
)
def test_config_refuses_bad_schedule_values_in_one_line(field, value, message):
    with pytest.raises(UsageError, match=f"optimizer.{field}={value!r}: {message}"):
        _run(steps=100, **{field: value})


def test_resumed_run_keeps_the_checkpoints_warmup_and_takes_the_new_length():
    from nnx_zoo.launch.resume import keep_schedule

    saved, _ = _run(steps=10, schedule="wsd")  # the smoke run: warmup cut to 8
    run, _ = _run(steps=60, schedule="wsd")  # the real run: the config's warmup of 20 fits
    kept, note = keep_schedule(run, saved)
    assert kept.optimizer.warmup_steps == 8 and kept.decay_steps == 60
    line = note(10)
    assert "\n" not in line
    assert line == (
        "resuming at step 10 of 60 (the checkpoint's run had 10): learning-rate schedule wsd: "
        "warmup 8, 0.003 to step 48, linear decay to 0.0003 at step 60, recomputed from the "
        "checkpoint's wsd: warmup 8, 0.003 to step 8, linear decay to 0.0003 at step 10; step "
        "11's rate is 0.003 (the checkpoint's schedule: 0.0003); the warmup stays the "
        "checkpoint's 8 steps, not the config's 20"
    )
    # The same run again (a preempted run resumed): nothing to say.
    same, note = keep_schedule(saved, saved)
    assert same == saved and note(5) is None


def test_resumed_cosine_is_recomputed_for_the_new_length():
    from nnx_zoo.launch.resume import keep_schedule

    saved, _ = _run(steps=100, warmup_steps=10)
    run, _ = _run(steps=300, warmup_steps=10)
    kept, note = keep_schedule(run, saved)
    assert kept == run  # same warmup: the config's run, as given
    want = reference("cosine", 50, warmup=10, length=300) * 3e-3 / PEAK
    assert f"step 51's rate is {want:.3g}" in note(50)


def test_a_warmup_kept_from_a_longer_schedule_is_cut_to_fit_the_shorter_one():
    from nnx_zoo.launch.resume import keep_schedule

    saved, _ = _run(steps=100, warmup_steps=50)
    run, _ = _run(steps=30, warmup_steps=5)  # resumed shorter, before the old warmup ended
    kept, note = keep_schedule(run, saved)
    assert kept.optimizer.warmup_steps == 29
    assert note(20).endswith(
        "; the warmup stays the checkpoint's 50 steps, cut to 29 to fit, not the config's 5"
    )
