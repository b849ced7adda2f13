"""Learning-rate schedules: warmup then cosine, WSD (warmup, stable, decay) or constant.

Each is a function of the optimizer's step count `t` (0 for the first update), with a linear
warmup from 0 to the peak over `warmup` steps and a schedule `length` (the step at which the
rate reaches its end value; `training.steps`, or `optimizer.decay_steps` when set):

- cosine:   peak * t/warmup, then end + (peak - end) * (1 + cos(pi * (t - warmup) /
            (length - warmup))) / 2 up to `length`, then `end`.
- wsd:      peak * t/warmup, then `peak` until the decay starts at `length - decay`, where
            `decay = decay_window(length, decay_fraction)`, then over those `decay` steps
            linear:  peak + (end - peak) * s, or
            1-sqrt:  end + (peak - end) * (1 - sqrt(s)),  s = (t - length + decay) / decay,
            then `end`. Only the decay depends on `length`, which is why a WSD run extended
            from a stable-phase checkpoint goes on at the peak and decays before its new end.
- constant: peak * t/warmup, then `peak`.

The arithmetic (`decay_window`, `max_warmup`) is plain Python, so the config checks use it
without importing JAX; `make_schedule` builds the optax schedule.
"""

from __future__ import annotations

SCHEDULES = ("cosine", "wsd", "constant")
DECAY_SHAPES = ("linear", "1-sqrt")


def decay_window(length: int, decay_fraction: float) -> int:
    """WSD's decay: the last `decay_fraction` of `length` steps, rounded half up, at least
    one step."""
    # The epsilon: a product floating point puts a hair under a half still rounds up, as
    # it would by hand.
    return min(length, max(1, int(decay_fraction * length + 0.5 + 1e-9)))


def max_warmup(kind: str, length: int, decay_fraction: float) -> int:
    """The longest warmup a schedule of `length` steps takes: cosine and constant need one
    step after it (at the peak), WSD its whole decay window."""
    if kind == "wsd":
        return length - decay_window(length, decay_fraction)
    return length - 1


def make_schedule(
    kind: str,
    *,
    learning_rate: float,
    warmup_steps: int,
    total_steps: int,
    end_learning_rate_ratio: float = 0.1,
    decay_fraction: float = 0.2,
    decay_shape: str = "linear",
):
    """The optax schedule (step -> rate) of the module docstring's `kind`.

    Args:
      kind: 'cosine', 'wsd' or 'constant'.
      learning_rate: the peak rate, reached at `warmup_steps`.
      warmup_steps: linear warmup from 0; at most `max_warmup(kind, total_steps, ...)`.
      total_steps: the schedule's length (the step its decay ends); unused by 'constant'
        except to bound the warmup.
      end_learning_rate_ratio: the end rate (cosine, wsd) as a fraction of the peak.
      decay_fraction: wsd: the decay's share of `total_steps` (`decay_window`).
      decay_shape: wsd: 'linear' or '1-sqrt'.
    """
    import jax.numpy as jnp
    import optax

    from nnx_zoo.errors import UsageError

    if kind not in SCHEDULES:
        raise UsageError(f"schedule {kind!r} is not one of {', '.join(SCHEDULES)}")
    if decay_shape not in DECAY_SHAPES:
        raise UsageError(f"decay_shape {decay_shape!r} is not one of {', '.join(DECAY_SHAPES)}")
    if total_steps < 1:
        raise UsageError(f"a schedule needs total_steps >= 1, got {total_steps}")
    limit = max_warmup(kind, total_steps, decay_fraction)
    if not 0 <= warmup_steps <= limit:
        raise UsageError(
            f"warmup_steps={warmup_steps} does not fit a {kind} schedule of {total_steps} "
            f"steps: use 0..{limit}"
        )
    peak, end = learning_rate, learning_rate * end_learning_rate_ratio
    if kind == "cosine":
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0,
            peak_value=peak,
            warmup_steps=warmup_steps,
            decay_steps=total_steps,
            end_value=end,
        )
    pieces, boundaries = [], []
    if warmup_steps:
        pieces.append(optax.linear_schedule(0.0, peak, warmup_steps))
        boundaries.append(warmup_steps)
    pieces.append(optax.constant_schedule(peak))
    if kind == "wsd":
        decay = decay_window(total_steps, decay_fraction)
        if decay_shape == "linear":
            pieces.append(optax.linear_schedule(peak, end, decay))
        else:

            def one_minus_sqrt(count):
                s = jnp.clip(count / decay, 0.0, 1.0)
                return end + (peak - end) * (1.0 - jnp.sqrt(s))

            pieces.append(one_minus_sqrt)
        boundaries.append(total_steps - decay)
    if len(pieces) == 1:
        return pieces[0]
    return optax.join_schedules(pieces, boundaries)


def describe(
    kind: str,
    *,
    learning_rate: float,
    warmup_steps: int,
    total_steps: int,
    end_learning_rate_ratio: float,
    decay_fraction: float,
    decay_shape: str,
) -> str:
    """The schedule in a few words, for the line a resumed run prints."""
    warmup = f"warmup {warmup_steps}, "
    peak, end = f"{learning_rate:.3g}", f"{learning_rate * end_learning_rate_ratio:.3g}"
    if kind == "constant":
        return f"constant: {warmup}then {peak}"
    if kind == "cosine":
        return f"cosine: {warmup}{peak} decaying to {end} at step {total_steps}"
    start = total_steps - decay_window(total_steps, decay_fraction)
    decay = f"{decay_shape} decay to {end} at step {total_steps}"
    return f"wsd: {warmup}{peak} to step {start}, {decay}"
