"""Strategies are rule tables: a new one is a few lines, the default mesh fits every model,
and the declared layouts of the four named strategies are pinned by golden files.

A table's strategy is run and compared with the one-device run as every named strategy is
(test_strategies_equal_one_device.py: its run, and its tolerances).
"""

from __future__ import annotations

import jax
import pytest
import test_strategies_equal_one_device as equal
from flax import nnx
from model_utils import one_device_mesh

from shardings import STRATEGIES, get_strategy
from shardings.strategies import DATA, MODEL, Strategy
from zoo import check_model_fits, create_model, get_config
from zoo.registry import presets

CFG = get_config("tiny")

# Megatron sequence parallelism on top of tp: between blocks the residual stream is split
# on T over `model`, so o and down reduce-scatter into it and each norm's output is
# all-gathered on T before the next matmul.
TP_SEQUENCE_RESIDUAL = Strategy(
    name="tp_sp",
    axes=(DATA, MODEL),
    rules={
        "batch": DATA,
        "heads": MODEL,
        "kv_heads": MODEL,
        "ffn": MODEL,
        "vocab": MODEL,
        "table_embed": MODEL,
        "residual_seq": MODEL,
    },
)


@pytest.fixture(scope="module")
def reference():
    return equal._run("dp", one_device_mesh())


@pytest.fixture(scope="module")
def sequence_parallel(reference):
    mesh = TP_SEQUENCE_RESIDUAL.make_mesh(shape=(4, 2))
    return equal._run(TP_SEQUENCE_RESIDUAL, mesh, init_params=reference["params"])


def test_strategy_from_a_table_equals_one_device(sequence_parallel, reference):
    equal.assert_step_equals_one_device(sequence_parallel, reference)


def test_strategy_from_a_table_splits_the_residual_on_seq(sequence_parallel):
    blocks = [(declared, live) for kind, declared, live in sequence_parallel["records"]]
    assert blocks, "no module output was recorded"
    for declared, live in blocks:
        assert live == declared
    residual = TP_SEQUENCE_RESIDUAL.lm_sharding().block.residual
    assert residual == jax.sharding.PartitionSpec(DATA, MODEL, None)
    block_outs = [live for kind, _, live in sequence_parallel["records"] if kind == "Block"]
    assert block_outs and all(live == residual for live in block_outs)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_default_mesh_without_config_fits_every_preset(name):
    # check_model_fits is the check create_model runs first; it is what rejected tp on tiny.
    strategy = get_strategy(name)
    mesh = strategy.make_mesh()
    assert mesh.devices.size == 8
    for preset in presets():
        check_model_fits(get_config(preset), strategy, mesh)


def test_default_mesh_without_config_builds_tiny_under_tp():
    strategy = get_strategy("tp")
    with jax.set_mesh(strategy.make_mesh()):
        model = create_model(CFG, strategy, rngs=nnx.Rngs(0))
    assert model.embed.table[...].sharding.mesh.devices.size == 8


def test_default_mesh_with_config_splits_what_the_model_allows():
    # tiny: 8 heads, 4 kv heads, F 128, V 512, M 64: `model` up to 4 divides them all.
    assert get_strategy("tp").default_mesh_shape(8, CFG) == (2, 4)
    assert get_strategy("fsdp_tp").default_mesh_shape(8, CFG) == (4, 2)
    one_kv_head = CFG.replace(num_heads=4, num_kv_heads=1)
    assert get_strategy("tp").default_mesh_shape(8, one_kv_head) == (8, 1)
    assert get_strategy("fsdp").default_mesh_shape(8, CFG) == (8,)


@pytest.mark.parametrize(
    "rules,message",
    [
        ({"batch": DATA, "kv_head": MODEL}, r"unknown logical dim 'kv_head'; valid: batch, seq"),
        ({"batch": "expert"}, r"rule 'batch' -> 'expert' names an axis outside"),
    ],
)
def test_bad_rule_table_is_rejected(rules, message):
    with pytest.raises(ValueError, match=message):
        Strategy(name="bad", axes=(DATA, MODEL), rules=rules)
