"""Each named strategy's layouts equal the golden file in tests/golden/, so that a layout
change shows in review as a diff of that file. Regenerate after an intended change with
`python explain_main.py --write_golden=tests/golden`."""

from __future__ import annotations

import pathlib

import pytest

from shardings import STRATEGIES
from shardings.explain import layout_report
from zoo import get_config, param_layouts

GOLDEN = pathlib.Path(__file__).parent / "golden"


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_layout_report_equals_golden_file(name):
    strategy = STRATEGIES[name]
    got = layout_report(name, param_layouts(get_config("tiny"), strategy), strategy.lm_sharding())
    want = (GOLDEN / f"{name}.txt").read_text()
    assert got == want, (
        f"the {name} layouts differ from tests/golden/{name}.txt; if the change is intended, "
        "regenerate with `python explain_main.py --write_golden=tests/golden`"
    )


def test_every_strategy_has_a_golden_file():
    assert sorted(p.stem for p in GOLDEN.glob("*.txt")) == sorted(STRATEGIES)
