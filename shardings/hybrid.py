"""Device meshes whose outer `replica` axis crosses slices (DCN) and whose inner axes stay
inside one slice (ICI / NVLink).

A *granule* is the unit the slow links join: a TPU slice (devices carry `slice_index`), or
else a process (a GPU node, or one simulated "slice" on CPU). Hybrid sharded data parallelism
only pays off when the `replica` all-reduce is the sole collective that leaves a granule, so
the device array is built granule by granule and stacked along `replica`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from jax.experimental import mesh_utils

from nnx_zoo.errors import UsageError

REPLICA = "replica"


def granules(devices: Sequence) -> list[list]:
    """`devices` grouped by slice, else by process; groups ordered by that index."""
    # Hosts of one TPU slice share its ICI, so there the slice is the unit; elsewhere (GPU
    # nodes, CPU processes standing in for slices) the process is.
    tpu_slices = devices[0].platform == "tpu" and hasattr(devices[0], "slice_index")
    key = "slice_index" if tpu_slices else "process_index"
    groups: dict[int, list] = {}
    for d in devices:
        groups.setdefault(getattr(d, key), []).append(d)
    return [sorted(groups[k], key=lambda d: d.id) for k in sorted(groups)]


def num_granules(devices: Sequence) -> int:
    return len(granules(devices))


def hybrid_device_array(shape: Sequence[int], axes: Sequence[str], devices: Sequence) -> np.ndarray:
    """Devices shaped `shape`; axis 0 must be `replica`, and its size a multiple of the
    granule count, so every other axis lies inside one granule.

    Raises UsageError (one line, with a valid alternative) when the shape cannot do that.
    """
    if axes[0] != REPLICA:
        raise UsageError(f"the {REPLICA!r} axis must come first in {tuple(axes)}")
    groups = granules(devices)
    g, replicas = len(groups), shape[0]
    if replicas % g:
        inner = ",".join(f"{a}:{s}" for a, s in zip(axes[1:], shape[1:], strict=True))
        raise UsageError(
            f"mesh axis {REPLICA}={replicas} must be a multiple of the {g} slices/processes, "
            f"so that {inner} stay inside one; e.g. {REPLICA}:{g} and the other axes "
            f"multiplying to {math.prod(shape) // g}"
        )
    per_granule = (replicas // g, *shape[1:])
    # Inside a granule the usual topology-aware placement (physical axes may be split: a
    # 4x4x4 slice holds an 8x8 inner mesh only that way).
    blocks = [
        mesh_utils.create_device_mesh(per_granule, group, allow_split_physical_axes=True)
        for group in groups
    ]
    return np.concatenate(blocks, axis=0)


def crossing_axes(mesh) -> tuple[str, ...]:
    """The mesh axes along which devices of different granules meet (should be `replica`
    alone, or nothing on one slice)."""
    devices = mesh.devices
    group_of = {d.id: i for i, grp in enumerate(granules(list(devices.flat))) for d in grp}
    ids = np.vectorize(lambda d: group_of[d.id])(devices)
    out = []
    for axis, name in enumerate(mesh.axis_names):
        if np.any(np.diff(ids, axis=axis) != 0):
            out.append(name)
    return tuple(out)


def partition_slices(mesh) -> list[int]:
    """The slice of each device of `mesh` in order (`mesh.devices.flat`, the partition ids of
    compiled HLO). One host standing in for several slices (a simulated CPU run, or a plan)
    counts the `replica` coordinate as the slice, which is what the hybrid mesh makes it."""
    flat = list(mesh.devices.flat)
    if num_granules(flat) > 1:
        group_of = {d.id: i for i, grp in enumerate(granules(flat)) for d in grp}
        return [group_of[d.id] for d in flat]
    if REPLICA in mesh.axis_names:
        coords = np.indices(mesh.devices.shape)[mesh.axis_names.index(REPLICA)]
        return [int(c) for c in coords.reshape(-1)]
    return [0] * len(flat)
