"""Shared by the parity tests against the Hugging Face references (tests/hf_reference/, made
by make_reference.py): which families have one, their inputs and logits tiled to 8 rows, a
reference checkpoint loaded once per strategy and mesh, and the checks every family passes
(weights in their declared layouts, an export that is the reference's very tensors).

The reference files are read with numpy only; neither torch nor transformers is imported.
"""

from __future__ import annotations

import functools
import pathlib

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zoo
from shardings import get_strategy
from zoo import hf_io

REF = pathlib.Path(__file__).parent / "hf_reference"
# The references are [2, 24]; tiled to 8 rows so that `data` (up to 8) divides the batch.
TILE = 4


def families(*, moe: bool) -> tuple[str, ...]:
    """The registered families with a reference: the mixture-of-experts ones, or the dense."""
    return tuple(
        sorted(
            name
            for name, family in zoo.registry.FAMILIES.items()
            if (REF / name).is_dir()
            and bool(zoo.get_config(next(iter(family.presets))).num_experts) == moe
        )
    )


def reference(family: str) -> dict[str, np.ndarray]:
    """The reference's arrays, `input_ids` [8, 24] and `logits` [8, 24, V] tiled."""
    data = dict(np.load(REF / family / "inputs_and_logits.npz"))
    data["input_ids"] = np.tile(data["input_ids"], (TILE, 1))
    data["logits"] = np.tile(data["logits"], (TILE, 1, 1))
    return data


@functools.cache
def loaded(family: str, strategy_name: str, shape: tuple[int, ...]):
    """(strategy, mesh, model) loaded from the reference checkpoint; cached across tests."""
    strategy = get_strategy(strategy_name)
    mesh = strategy.make_mesh(shape=shape)
    with jax.set_mesh(mesh):
        model = zoo.from_pretrained(str(REF / family), strategy)
    return strategy, mesh, model


def batch_args(strategy, mesh, tokens_BT) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(tokens, segment ids, positions) of one document per row, in the batch layout."""
    B, T = tokens_BT.shape
    batch = NamedSharding(mesh, strategy.batch_spec())
    positions_BT = np.broadcast_to(np.arange(T), (B, T))
    return tuple(
        jax.device_put(np.asarray(x, np.int32), batch)
        for x in (tokens_BT, np.ones((B, T)), positions_BT)
    )


def flat_params(model) -> dict[str, jax.Array]:
    return {
        "/".join(map(str, path)): var.get_value()
        for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }


def assert_declared_layouts(model, strategy, mesh) -> None:
    """Every weight landed directly in the layout its strategy declares."""
    layouts = {path: spec for path, _, spec in zoo.param_layouts(model.cfg, strategy)}
    for path, value in flat_params(model).items():
        want = NamedSharding(mesh, P(*layouts[path]))
        assert value.sharding.is_equivalent_to(want, value.ndim), (path, value.sharding)


def assert_export_is_the_reference(model, out, family: str, **save_kwargs) -> None:
    """save_pretrained writes the reference checkpoint's very tensors and config."""
    zoo.save_pretrained(model, str(out), **save_kwargs)
    exported, ref = hf_io.CheckpointReader(str(out)), hf_io.CheckpointReader(REF / family)
    assert sorted(exported.names()) == sorted(ref.names())
    for name in ref.names():
        a, b = exported.read(name), ref.read(name)
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), name
    assert hf_io.read_config(str(out)) == hf_io.read_config(str(REF / family))


def assert_same_params(model, other) -> None:
    before, after = flat_params(model), flat_params(other)
    assert before.keys() == after.keys()
    for path in before:
        assert np.array_equal(np.asarray(before[path]), np.asarray(after[path])), path
