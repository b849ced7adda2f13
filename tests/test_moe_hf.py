"""Qwen3-MoE and Mixtral against transformers (tests/hf_reference/, made by make_reference.py):
logits and the load-balancing loss under dp, fsdp_tp and fsdp_ep (4 experts on expert axes of
2 and 4), bit-exact export/import, and a checkpoint with the wrong expert count.

The reference files are read with numpy only; neither torch nor transformers is imported.
"""

from __future__ import annotations

import functools
import json
import pathlib
import shutil

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zoo
from shardings import get_strategy
from zoo import hf_io

REF = pathlib.Path(__file__).parent / "hf_reference"
# The registered mixture-of-experts families with a reference.
FAMILIES = tuple(
    sorted(
        name
        for name, family in zoo.registry.FAMILIES.items()
        if (REF / name).is_dir() and zoo.get_config(next(iter(family.presets))).num_experts
    )
)
# Both sides compute in float32 and differ by summation order (and, sharded, by partial sums
# reduced across devices) -- the same bound as the dense families' parity test. A routing
# convention gotten wrong (top-k renormalisation, one expert fewer) moves these logits by 1.5
# or more (make_reference.py's ablations), so 1e-4 cannot hide one.
ATOL = 1e-4
# The aux loss is a sum of E products of means over 48 rows x 2 layers; float32 rounding
# of those sums stays far below 1e-5 of its value (about 2).
AUX_RTOL = 1e-5
TILE = 4  # the [2, 24] references tiled to 8 rows, so the batch splits over 8 devices
CASES = [
    (family, name, shape)
    for family in FAMILIES
    for name, shape in (("dp", (8,)), ("fsdp_tp", (4, 2)), ("fsdp_ep", (4, 2)), ("fsdp_ep", (2, 4)))
]


@functools.cache
def _loaded(family, strategy_name, shape):
    strategy = get_strategy(strategy_name)
    mesh = strategy.make_mesh(shape=shape)
    with jax.set_mesh(mesh):
        model = zoo.from_pretrained(str(REF / family), strategy)
    return strategy, mesh, model


def _forward(strategy, mesh, model, tokens_BT):
    B, T = tokens_BT.shape
    batch = NamedSharding(mesh, strategy.batch_spec())
    put = lambda x: jax.device_put(np.asarray(x, np.int32), batch)  # noqa: E731
    positions_BT = np.broadcast_to(np.arange(T), (B, T))
    with jax.set_mesh(mesh):
        forward = nnx.jit(lambda m, t, s, p: m.forward(t, segment_ids=s, positions=p)[::2])
        logits, stats = forward(model, put(tokens_BT), put(np.ones((B, T))), put(positions_BT))
        return np.asarray(logits), float(stats.aux_loss)


def _flat_params(model):
    return {
        "/".join(map(str, path)): var.get_value()
        for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }


@pytest.mark.parametrize("family,strategy_name,shape", CASES)
def test_logits_and_aux_loss_equal_transformers(family, strategy_name, shape):
    strategy, mesh, model = _loaded(family, strategy_name, shape)
    data = np.load(REF / family / "inputs_and_logits.npz")
    tokens_BT = np.tile(data["input_ids"], (TILE, 1))
    logits_BTV, aux = _forward(strategy, mesh, model, tokens_BT)
    diff = np.abs(logits_BTV - np.tile(data["logits"], (TILE, 1, 1))).max()
    assert diff <= ATOL, f"{family} {strategy_name} {shape}: max abs logit diff {diff:.2e}"
    # Tiling the batch repeats every token 4 times: the means, hence the loss, are unchanged.
    np.testing.assert_allclose(aux, float(data["aux_loss"]), rtol=AUX_RTOL)

    layouts = {path: spec for path, _, spec in zoo.param_layouts(model.cfg, strategy)}
    for path, value in _flat_params(model).items():
        want = NamedSharding(mesh, P(*layouts[path]))
        assert value.sharding.is_equivalent_to(want, value.ndim), (path, value.sharding)
    if strategy_name == "fsdp_ep":  # each device holds E / expert whole experts
        gate = model.blocks.moe.gate.get_value()
        assert gate.addressable_shards[0].data.shape[1] == 4 // mesh.shape["expert"]


@pytest.mark.parametrize("family", FAMILIES)
def test_export_then_import_is_bit_exact(family, tmp_path):
    """fsdp_ep model -> save_pretrained -> the very tensors of the reference checkpoint, and
    from_pretrained onto another strategy -> the very same params."""
    _, _, model = _loaded(family, "fsdp_ep", (2, 4))
    out = tmp_path / family
    zoo.save_pretrained(model, str(out))
    exported, reference = hf_io.CheckpointReader(str(out)), hf_io.CheckpointReader(REF / family)
    assert sorted(exported.names()) == sorted(reference.names())
    for name in reference.names():
        a, b = exported.read(name), reference.read(name)
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), name
    assert hf_io.read_config(str(out)) == hf_io.read_config(str(REF / family))

    _, _, again = _loaded(family, "fsdp_tp", (4, 2))
    before, after = _flat_params(model), _flat_params(again)
    assert before.keys() == after.keys()
    for path in before:
        assert np.array_equal(np.asarray(before[path]), np.asarray(after[path])), path


@pytest.mark.parametrize("family", FAMILIES)
def test_wrong_expert_count_fails_with_one_line(family, tmp_path):
    """config.json says 8 experts, the weights hold 4 per layer."""
    bad = tmp_path / "bad"
    shutil.copytree(REF / family, bad)
    config = json.loads((bad / "config.json").read_text())
    key = "num_experts" if "num_experts" in config else "num_local_experts"
    config[key] = 8
    (bad / "config.json").write_text(json.dumps(config))
    strategy = get_strategy("dp")
    with jax.set_mesh(strategy.make_mesh()), pytest.raises(ValueError) as err:
        zoo.from_pretrained(str(bad), strategy)
    message = str(err.value)
    assert "\n" not in message
    assert "layer 0 has 4 experts" in message and "num_experts=8" in message, message
