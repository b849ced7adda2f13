"""The advice plan_main gives when nothing fits is never a change that raises the peak.

Found running gpt-oss-20b under fsdp_tp_ep on h100:8 (docs/gpt_oss.md): the planner advised
`--micro_batches=2`, which added a float32 gradient accumulator and shrank almost nothing, so
the step needed 68.09 GiB instead of 56.55. The same happens to a tiny model on h100:8 at 16
tokens a row, where the gradients outweigh what the micro-batches split: one step compiled
per advice (~10 s each on 2 cores), module-scoped.
"""

from __future__ import annotations

import pytest

from nnx_zoo.planning.compile import Candidate, make_target
from nnx_zoo.planning.search import accumulator_bytes, cached_compile, candidate_space, search
from nnx_zoo.training.config import RunConfig

SHAPES = dict(hidden_dim=64, num_layers=2, head_dim=8, ffn_dim=128)


def _run(batch: int = 16) -> RunConfig:
    model = {"preset": "tiny", **SHAPES, "remat": "full", "dtype": "bfloat16"}
    return RunConfig.from_config_dict(
        {"model": model, "data": {"seq_len": 16, "global_batch_size": batch}}
    )


@pytest.fixture(scope="module")
def plans():
    """(one micro-batch's plan, two micro-batches' plan) of fsdp on h100:8, in the search's
    cache: the search below compiles neither again."""
    target = make_target("h100:8")
    one = cached_compile(_run(), Candidate("fsdp", (8,), "full", 1), target)
    two = cached_compile(_run(), Candidate("fsdp", (8,), "full", 2), target)
    return one, two


def test_two_micro_batches_raise_this_steps_peak(plans):
    # The premise: the accumulator (the float32 gradients) outweighs what halving the rows
    # saves, so advising --micro_batches=2 here would make the step need more memory.
    one, two = plans
    assert accumulator_bytes(one.state, 1, 2) == one.state.gradients > 0
    assert accumulator_bytes(one.state, 2, 4) == 0
    assert two.required_bytes > one.required_bytes, (one.required_bytes, two.required_bytes)


def test_advice_is_compiled_before_it_is_given(plans):
    one, two = plans
    run = _run()
    # Just under what one micro-batch needs: before, the planner advised --micro_batches=2.
    target = make_target("h100:8", (one.required_bytes - 1) / 2**30)
    candidates = candidate_space(run, target, ["fsdp"], ("full",), (1,), {"fsdp": (8,)})
    result = search(run, target, candidates, exhaustive=True)
    assert result.best is None
    advice = result.reason.rsplit("; ", 1)[-1]
    assert "--micro_batches" not in advice, result.reason
    # What was compiled and refused is said, with the accumulator that made it worse.
    assert "--micro_batches=2 would need" in result.reason, result.reason
    assert "gradient accumulator" in result.reason, result.reason
    if "--batch_size=" in advice:
        # A smaller batch is advised only where its compiled step fits.
        smaller = int(advice.split("--batch_size=")[1].split()[0])
        plan = cached_compile(_run(smaller), one.candidate, target)
        assert plan.fits and plan.required_bytes < one.required_bytes, result.reason
    else:
        assert "more chips" in advice, result.reason
