"""Adding a family and adding a strategy take the places docs/ARCHITECTURE.md lists and no
more: here both are made from test code alone (a config class + a registry entry; a rule
table + a STRATEGIES entry) and trained through the assembly train_main uses.

Tolerance as in test_strategies_equal_one_device.py: float32, a split contraction sums in
another order than one device, so 2e-5 absolute on the loss.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from nnx_zoo.launch.build import build
from nnx_zoo.launch.data import build_data
from nnx_zoo.training.config import RunConfig
from shardings import STRATEGIES
from shardings.strategies import DATA, MODEL, Strategy
from zoo.layers.config import DecoderConfig
from zoo.layers.decoder import DecoderLM
from zoo.registry import FAMILIES, Family, preset_table, register


@dataclasses.dataclass(frozen=True, kw_only=True)
class WideRopeConfig(DecoderConfig):
    """A new family is configuration: here Llama's blocks with another RoPE base and norm eps."""

    rope_theta: float = 50_000.0
    norm_eps: float = 1e-6


class WideRope(DecoderLM):
    pass


# FSDP over `data` and tensor parallelism over `model` for the MLP only: attention stays
# whole on every `model` device (its heads are not in the table).
MLP_ONLY_TP = Strategy(
    name="fsdp_mlp_tp",
    axes=(DATA, MODEL),
    rules={"batch": DATA, "embed_fsdp": DATA, "ffn": MODEL},
)


@pytest.fixture
def family_and_strategy():
    register(
        Family(
            name="wide_rope",
            config_cls=WideRopeConfig,
            model_cls=WideRope,
            presets=preset_table(
                # V, M, L, N, K, D, F, T: zoo.registry.PRESET_DIMS
                WideRopeConfig,
                {"wide-rope-small": (512, 64, 2, 4, 2, 16, 128, 64)},
            ),
        )
    )
    STRATEGIES[MLP_ONLY_TP.name] = MLP_ONLY_TP
    try:
        yield
    finally:
        FAMILIES.pop("wide_rope")
        STRATEGIES.pop(MLP_ONLY_TP.name)


def _losses(strategy: str, mesh_shape: str, steps: int = 3) -> list[float]:
    run = RunConfig.from_config_dict(
        {
            "model": {"preset": "wide-rope-small"},
            "data": {"seq_len": 32, "global_batch_size": 8},
            "training": {"sharding_strategy": strategy, "mesh_shape": mesh_shape, "steps": steps},
        }
    )
    devices = jax.devices()[: 1 if mesh_shape == "data:1" else 8]
    built = build(run, devices=devices)
    mesh = built.mesh
    batches = build_data(run, mesh, built.batch_spec).train_batches
    with jax.set_mesh(mesh):
        return [float(built.trainer.train_step(next(batches))["loss"]) for _ in range(steps)]


def test_a_new_family_and_a_new_strategy_train_and_equal_one_device(family_and_strategy):
    reference = _losses("dp", "data:1")
    sharded = _losses("fsdp_mlp_tp", "data:4,model:2")
    np.testing.assert_allclose(sharded, reference, atol=2e-5, rtol=0)
    assert reference[-1] < reference[0]
