"""Per-device memory of a compiled step: the one formula, for run_info.json and the planner.

Both train_main (the step it compiled to run) and plan_main (the same step compiled on
abstract state, possibly for a target this host does not have) read their figures here, so
the two agree byte for byte for the same command line on the same devices.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

BATCH_FIELDS = ("tokens", "segment_ids", "positions")


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """XLA's per-device figures for one compiled step, in bytes."""

    argument_bytes: int
    output_bytes: int
    alias_bytes: int  # outputs that reuse (donated) argument buffers
    temp_bytes: int
    # XLA's own peak where the backend reports one (TPU, GPU). The CPU backend's figure leaves
    # out the temporaries (it reports about the argument size), so there, and wherever no
    # peak is reported, it is the bound argument + output - alias + temp.
    peak_bytes: int
    host_temp_bytes: int  # pinned host memory (remat='offload'), not the device's

    @property
    def live_bytes(self) -> int:
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

    @property
    def required_bytes(self) -> int:
        """What must fit: the peak, or the live total when larger (TPU's reported peak can
        sit below its own temp allocation)."""
        return max(self.peak_bytes, self.live_bytes)

    def to_json(self) -> dict[str, int]:
        return {**dataclasses.asdict(self), "required_bytes": self.required_bytes}


def step_memory(compiled) -> StepMemory | None:
    """The figures of a jax `Compiled` (None where XLA gives none)."""
    memory = compiled.memory_analysis()
    if memory is None:
        return None
    argument, temp = int(memory.argument_size_in_bytes), int(memory.temp_size_in_bytes)
    output, alias = int(memory.output_size_in_bytes), int(memory.alias_size_in_bytes)
    peak = int(getattr(memory, "peak_memory_in_bytes", 0) or 0)
    if _platform(compiled) == "cpu" or not peak:
        peak = argument + output - alias + temp
    host = int(getattr(memory, "host_temp_size_in_bytes", 0) or 0)
    return StepMemory(argument, output, alias, temp, peak, host)


def _platform(compiled) -> str | None:
    for sharding in jax.tree.leaves(compiled.input_shardings):
        mesh = getattr(sharding, "mesh", None)
        if mesh is not None and getattr(mesh, "devices", None) is not None:
            return mesh.devices.flat[0].platform
        devices = getattr(sharding, "device_set", None)
        if devices:
            return next(iter(devices)).platform
    return None


def abstract_batch(mesh, spec, batch_size: int, seq_len: int) -> dict[str, jax.ShapeDtypeStruct]:
    """tokens / segment_ids / positions as int32 [B, T] shapes in layout `spec` on `mesh`:
    what the data pipeline's global batches look like to the compiler."""
    arr = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32, sharding=NamedSharding(mesh, spec))
    return dict.fromkeys(BATCH_FIELDS, arr)
