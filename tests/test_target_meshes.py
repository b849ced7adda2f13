"""Every strategy's default mesh builds on big TPU slices, whose torus dims a logical mesh
axis must be allowed to split (data 8 x model 8 on v5p:4x4x4, model 4 on v6e:4x4)."""

import pytest

from nnx_zoo.planning import target_devices
from shardings import STRATEGIES
from zoo import get_config


@pytest.mark.tpu_compile
@pytest.mark.parametrize("topology", ["v5p:4x4x4", "v6e:4x4"])
@pytest.mark.parametrize("preset", ["llama3.1-8b", "tiny"])
def test_every_default_mesh_builds_on_the_slice(topology, preset):
    devices = target_devices(topology)
    cfg = get_config(preset)
    for strategy in STRATEGIES.values():
        mesh = strategy.make_mesh(devices=devices, config=cfg)  # its default shape
        assert mesh.axis_names == strategy.axes
        assert mesh.size == len(devices)
        # Every chip once: a mesh is a permutation of the slice.
        assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in devices)
