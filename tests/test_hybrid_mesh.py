"""The hybrid (multi-slice) mesh: `replica` crosses slices, every other axis stays inside one.

Devices are stand-ins carrying the attributes the mesh builder reads, so layouts of 2 or 4
"processes" are checked without starting them (tests/test_multiprocess.py trains on real ones).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from shardings import get_strategy, parse_mesh_shape
from shardings.hybrid import hybrid_device_array
from zoo import get_config


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    id: int
    process_index: int
    platform: str = "cpu"
    device_kind: str = "cpu"


def _devices(processes: int, per_process: int) -> list[FakeDevice]:
    return [
        FakeDevice(id=p * per_process + i, process_index=p)
        for p in range(processes)
        for i in range(per_process)
    ]


def _process_grid(array: np.ndarray) -> np.ndarray:
    return np.vectorize(lambda d: d.process_index)(array)


def test_cli_mesh_shape_names_the_replica_axis():
    axes = get_strategy("hsdp_tp").axes
    assert parse_mesh_shape("replica:2,data:2,model:2", axes) == (2, 2, 2)
    assert parse_mesh_shape("model:2,replica:2,data:2", axes) == (2, 2, 2)


@pytest.mark.parametrize(
    "processes,shape",
    [(2, (2, 2, 2)), (2, (4, 1, 2)), (4, (4, 1, 2))],
)
def test_replica_crosses_processes_and_inner_axes_do_not(processes, shape):
    devices = _devices(processes, 8 // processes)
    grid = _process_grid(hybrid_device_array(shape, ("replica", "data", "model"), devices))
    per_replica = grid.reshape(shape[0], -1)
    # Every replica lies in one process, and the processes appear in order along `replica`.
    assert all(len(set(row)) == 1 for row in per_replica)
    assert sorted(set(per_replica[:, 0])) == list(range(processes))
    assert list(per_replica[:, 0]) == sorted(per_replica[:, 0])


def test_replica_smaller_than_process_count_is_refused():
    with pytest.raises(ValueError, match=r"replica=1 must be a multiple of the 2 slices"):
        hybrid_device_array((1, 4, 2), ("replica", "data", "model"), _devices(2, 4))


def test_default_mesh_puts_one_replica_per_slice():
    hsdp_tp = get_strategy("hsdp_tp")
    tiny = get_config("tiny")  # 4 kv heads
    assert hsdp_tp.default_mesh_shape(16, tiny, num_slices=2) == (2, 4, 2)
    assert get_strategy("hsdp").default_mesh_shape(8, num_slices=1) == (1, 8)


def test_only_the_replica_reduction_crosses_slices_in_compiled_hsdp():
    """A data-parallel matmul's gradient under hsdp on replica:2 x data:4, as XLA compiles it:
    the FSDP all-gather and the reduction over `data` stay in a slice; the reduction over
    `replica` is the collective that crosses (counted from the HLO's device groups)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from shardings.explain import count_collectives_by_link
    from shardings.hybrid import partition_slices

    strategy = get_strategy("hsdp")
    mesh = strategy.make_mesh(shape="replica:2,data:4")
    assert partition_slices(mesh) == [0, 0, 0, 0, 1, 1, 1, 1]
    with jax.set_mesh(mesh):
        x_BM = jax.device_put(np.ones((8, 16), np.float32), strategy.batch_spec())
        w_MF = jax.device_put(np.ones((16, 32), np.float32), P("data", None))
        grad = jax.grad(lambda w, x: jnp.sin(jnp.einsum("bm,mf->bf", x, w)).sum())
        hlo = jax.jit(grad).lower(w_MF, x_BM).compile().as_text()
    by_link = count_collectives_by_link(hlo, partition_slices(mesh))
    assert by_link[("all-gather", "ici")] >= 1 and by_link[("all-gather", "dcn")] == 0
    assert by_link[("all-reduce", "dcn")] >= 1
    assert (
        sum(n for (_, link), n in by_link.items() if link == "dcn")
        == by_link[("all-reduce", "dcn")]
    )
