"""Every strategy in shardings.STRATEGIES has a case in the equality tests (the sharded run
equals the one-device run): a new strategy without one fails here, not silently untested.

The cases live in four modules, by the model they need: dense strategies on the tiny model
(test_strategies_equal_one_device), the expert-parallel ones on the tiny MoE
(test_moe_strategies), the pipeline ones with their schedules (test_pipeline_equal_one_device)
and with mixtures of experts (test_pipeline_moe).
"""

from __future__ import annotations

import test_moe_strategies as moe
import test_pipeline_equal_one_device as pipelined
import test_pipeline_moe as pipelined_moe
import test_strategies_equal_one_device as dense

from shardings import STRATEGIES, get_strategy


def _cases() -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """module -> its (strategy, mesh shape) cases."""
    return {
        "test_strategies_equal_one_device": [(s, m) for s, m, *_ in dense.CASES],
        "test_moe_strategies": [(s, m) for s, m in moe.CASES],
        "test_pipeline_equal_one_device": [(s, m) for s, m, *_ in pipelined.CASES],
        "test_pipeline_moe": [(s, m) for _, s, m, *_ in pipelined_moe.CASES],
    }


def test_every_strategy_has_an_equality_case():
    covered = {name for cases in _cases().values() for name, _ in cases}
    missing = [name for name in STRATEGIES if name not in covered]
    assert not missing, (
        f"strategies without a case in the equality tests: {missing}; add one to "
        f"{', '.join(_cases())}"
    )


def test_every_case_names_a_strategy_and_a_mesh_of_its_axes():
    for module, cases in _cases().items():
        for name, mesh_shape in cases:
            strategy = get_strategy(name)  # a renamed strategy leaves no stale case behind
            assert len(mesh_shape) == len(strategy.axes), (module, name, mesh_shape)
