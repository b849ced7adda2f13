"""Explicit-axes meshes, and the checks that run before any array is created."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

from nnx_zoo.errors import UsageError
from shardings.hybrid import REPLICA, hybrid_device_array, num_granules
from shardings.specs import axes_of, entry_size


def parse_mesh_shape(text: str, axes: Sequence[str]) -> tuple[int, ...]:
    """`'data:4,model:2'` (any order, every axis named) or `'4,2'` (in `axes` order)."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    valid = ",".join(f"{a}:N" for a in axes)
    if not parts:
        raise UsageError(f"empty mesh shape; expected {valid}")
    if all(":" in p for p in parts):
        sizes = {}
        for p in parts:
            name, _, size = p.partition(":")
            if name not in axes:
                raise UsageError(
                    f"mesh axis {name!r} is not used by this strategy; its axes are {list(axes)}"
                    f" (expected {valid})"
                )
            if name in sizes:
                raise UsageError(f"mesh shape {text!r} names axis {name!r} twice; expected {valid}")
            sizes[name] = _positive_int(size, text)
        missing = [a for a in axes if a not in sizes]
        if missing:
            raise UsageError(f"mesh shape {text!r} does not name axes {missing}; expected {valid}")
        return tuple(sizes[a] for a in axes)
    if any(":" in p for p in parts):
        raise UsageError(f"mesh shape {text!r} mixes named and bare sizes; expected {valid}")
    sizes = tuple(_positive_int(p, text) for p in parts)
    if len(sizes) != len(axes):
        raise UsageError(
            f"mesh shape {text!r} has {len(sizes)} axes; this strategy has {len(axes)} "
            f"({', '.join(axes)}); expected {valid}"
        )
    return sizes


def _positive_int(text: str, whole: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise UsageError(f"mesh shape {whole!r}: {text!r} is not an integer") from None
    if value < 1:
        raise UsageError(f"mesh shape {whole!r}: axis sizes must be >= 1, got {value}")
    return value


def make_mesh(strategy, shape=None, devices=None, config=None) -> Mesh:
    """A mesh with the strategy's axes, all `AxisType.Explicit`.

    `shape` is None (the strategy's documented default for these devices and `config`), a
    tuple, or a string for `parse_mesh_shape`. Raises UsageError when it does not fit the devices.
    """
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    if shape is None:
        shape = strategy.default_mesh_shape(n, config, num_slices=num_granules(devices))
    elif isinstance(shape, str):
        shape = parse_mesh_shape(shape, strategy.axes)
    shape = tuple(int(s) for s in shape)
    if len(shape) != len(strategy.axes):
        raise UsageError(
            f"mesh shape {shape} has {len(shape)} axes; strategy {strategy.name!r} has "
            f"{len(strategy.axes)} ({', '.join(strategy.axes)})"
        )
    if math.prod(shape) != n:
        named = ",".join(f"{a}:{s}" for a, s in zip(strategy.axes, shape, strict=True))
        raise UsageError(
            f"mesh shape {named} needs {math.prod(shape)} devices but {n} are available; "
            f"the axis sizes must multiply to {n}"
        )
    if REPLICA in strategy.axes:
        # `replica` must cross slices and nothing else may: built granule by granule.
        return Mesh(
            hybrid_device_array(shape, strategy.axes, devices),
            strategy.axes,
            axis_types=(AxisType.Explicit,) * len(shape),
        )
    # Split physical axes allowed: on a TPU torus a logical axis may then span parts of two
    # physical dims (data 8 x model 8 on a 4x4x4 v5p); without it such a shape has no
    # assignment at all. On CPU/GPU devices this is the plain ordering.
    device_grid = mesh_utils.create_device_mesh(
        shape, np.asarray(devices).reshape(-1), allow_split_physical_axes=True
    )
    return Mesh(device_grid, strategy.axes, axis_types=(AxisType.Explicit,) * len(shape))


def check_divisible(
    named_specs: Iterable[tuple[str, tuple[int, ...], P]], mesh: Mesh, strategy_name: str
) -> None:
    """Every sharded dim divides by the product of its mesh axes; else one clear line.

    `named_specs` yields (path, shape, spec) for each array the strategy lays out.
    """
    for path, shape, spec in named_specs:
        for dim, axes in enumerate(spec):
            if axes is None:
                continue
            axes, size = axes_of(axes), entry_size(axes, mesh.shape)
            if shape[dim] % size:
                axis_text = _axis_text(axes, mesh)
                raise UsageError(
                    f"{strategy_name}: {path} has shape {tuple(shape)}; its dim {dim} (size "
                    f"{shape[dim]}) is split over mesh axis {axis_text}, which does not divide "
                    f"it; choose a mesh whose {'/'.join(axes)} size divides {shape[dim]}"
                )


def check_batch(
    batch_size: int,
    batch_spec: P,
    mesh: Mesh,
    strategy_name: str,
    seq_len: int | None = None,
    residual_spec: P | None = None,
) -> None:
    """The batch dim of [B, T] inputs divides by the mesh axes it is split over, and so
    does T (into 2 load-balanced chunks per device) when it is split; and T divides by the
    axes the residual stream `residual_spec` ([B, T, M]) splits it over, when only the
    residual splits it (sequence parallelism)."""
    residual_seq = None if residual_spec is None or len(residual_spec) < 2 else residual_spec[1]
    batch_seq = batch_spec[1] if len(batch_spec) > 1 else None
    if seq_len is not None and residual_seq is not None and batch_seq is None:
        _check_seq_split(
            strategy_name,
            seq_len,
            residual_seq,
            mesh,
            "in the residual stream between blocks (sequence parallelism)",
        )
    if seq_len is not None and batch_seq is not None:
        _check_seq_split(
            strategy_name, seq_len, batch_seq, mesh, "in 2 load-balanced chunks per device", 2
        )
    axes = batch_spec[0] if len(batch_spec) else None
    if axes is None:
        return
    axes, size = axes_of(axes), entry_size(axes, mesh.shape)
    if batch_size % size:
        axis_text = _axis_text(axes, mesh)
        raise UsageError(
            f"{strategy_name}: batch size {batch_size} is split over mesh axis {axis_text}, "
            f"which does not divide it; use a batch size that is a multiple of {size}"
        )


def _check_seq_split(strategy_name, seq_len, seq_entry, mesh, how: str, chunks_per_device=1):
    """T divides into `chunks_per_device` pieces on each device of the axes `seq_entry` names."""
    seq_axes = axes_of(seq_entry)
    size = chunks_per_device * entry_size(seq_axes, mesh.shape)
    if seq_len % size:
        axis_text = _axis_text(seq_axes, mesh)
        raise UsageError(
            f"{strategy_name}: sequence length {seq_len} is split over mesh axis {axis_text} "
            f"{how}; use a sequence length that is a multiple of {size}"
        )


def _axis_text(axes, mesh) -> str:
    return "x".join(f"{a}={mesh.shape[a]}" for a in axes)


def compile_platform() -> str:
    """The platform the current trace compiles for: the mesh's devices when a mesh is set
    (an abstract TPU / GPU target on a CPU host), else this process's default backend."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else getattr(mesh, "abstract_device", None)
    platform = getattr(device, "platform", None)
    return platform or jax.default_backend()
