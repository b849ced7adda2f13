"""The compiled step's kernels by category (nnx_zoo/planning/breakdown.py, what
bench/step_breakdown.py prints): every kernel the forecast counts is in exactly one category,
and the model's and the step's named scopes put the head, the norms and the optimizer where
they belong. The trace side runs on a real trace in tests/test_profile.py."""

from __future__ import annotations

import pytest
from model_utils import one_device_mesh

from nnx_zoo.launch.build import abstract_run
from nnx_zoo.planning import breakdown
from nnx_zoo.planning.hlo_traffic import traffic
from zoo import get_config


@pytest.fixture(scope="module")
def program():
    cfg = get_config("tiny", num_layers=2, dtype="float32")
    built = abstract_run(cfg, "dp", one_device_mesh(), batch_size=2, seq_len=64, loss_chunk_size=32)
    compiled, _ = built.compile()
    return compiled.as_text()


def test_categories_add_up_to_the_forecast_counts(program):
    rows = breakdown.by_category(program)
    assert list(rows) == list(breakdown.CATEGORIES)
    total = traffic(program)
    assert sum(r.bytes for r in rows.values()) == pytest.approx(total.memory_bytes)
    kernels = sum(r.kernels for c, r in rows.items() if c != "collectives")
    assert kernels == total.kernels  # the forecast counts every kernel but collectives


def test_named_scopes_place_the_kernels(program):
    rows = breakdown.by_category(program)
    for category in ("gemm", "lm_head_loss", "norm_rotary_elementwise", "optimizer"):
        assert rows[category].kernels > 0, (category, rows)
    assert rows["gemm"].bytes == 0  # timed by FLOPs, as the forecast times them
    names = breakdown.instruction_categories(program)
    assert set(names.values()) <= set(breakdown.CATEGORIES)


@pytest.mark.parametrize(
    ("kind", "op_name", "expected"),
    [
        ("matmul", "jit(_train_step)/jvp(mlp)/BTM,MF->BTF/dot_general", "gemm"),
        ("matmul", "jit(_train_step)/transpose(jvp(lm_head_loss))/while/body/dot", "lm_head_loss"),
        ("memory", "jit(_train_step)/jvp(attention)/norm/mul", "norm_rotary_elementwise"),
        ("memory", "jit(_train_step)/jvp(attention)/rope/concatenate", "norm_rotary_elementwise"),
        ("memory", "jit(_train_step)/jvp(attention)/jit(_where)/select_n", "attention"),
        ("flash", "", "attention"),
        ("memory", "jit(_train_step)/optimizer/add", "optimizer"),
        ("collective", "jit(_train_step)/optimizer/all-reduce", "collectives"),
        ("memory", "jit(_train_step)/jvp(embed)/gather", "other"),
    ],
)
def test_category_rule(kind, op_name, expected):
    assert breakdown.category(kind, op_name) == expected


def test_layers_extrapolate_like_the_forecast():
    one = {c: breakdown.Row(2, 10.0) for c in breakdown.CATEGORIES}
    two = {c: breakdown.Row(3, 14.0) for c in breakdown.CATEGORIES}
    rows = breakdown.extrapolate(one, two, 16)
    assert rows["gemm"] == breakdown.Row(2 + 15 * 1, 10.0 + 15 * 4.0)
