"""Several processes: when to call `jax.distributed.initialize`, and process-local batches ->
global arrays.

`initialize` must run before anything touches a JAX backend (`jax.devices()`, an array).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_zoo.errors import UsageError

# Environment variables that say this process is one of several launched by a cluster manager
# whose environment jax.distributed.initialize() reads (Slurm, Open MPI, Cloud TPU). Auto-init
# happens only when one is set with more than one task, so a laptop run never waits for a
# coordinator that does not exist.
_TASK_COUNT_VARS = ("SLURM_NTASKS", "SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_SIZE")
# Multi-host TPU VMs list their workers here (comma-separated); a single host has one name.
_TPU_WORKERS_VAR = "TPU_WORKER_HOSTNAMES"


def detected_cluster() -> str | None:
    """The environment variable that reveals a multi-process launch, or None."""
    for var in _TASK_COUNT_VARS:
        value = os.environ.get(var, "")
        if value.isdigit() and int(value) > 1:
            return var
    if "," in os.environ.get(_TPU_WORKERS_VAR, ""):
        return _TPU_WORKERS_VAR
    return None


def jax_timeouts(peer_timeout_s: float) -> dict[str, int]:
    """`jax.distributed.initialize`'s timeouts for a run whose peers are watched with this
    bound (nnx_zoo/runtime/peers.py). JAX's heartbeat ends every process by LOG(FATAL) (SIGABRT
    and a fatal-error dump) once one is silent that long, and its exit barrier waits that long
    for the slowest process: twice the bound, so that the watch, which exits with one line, acts
    first and JAX's runtime is the backstop should the watch's thread not run. 0: JAX's
    defaults (100 s heartbeat, 300 s shutdown)."""
    if not peer_timeout_s:
        return {}
    backstop = max(1, math.ceil(2 * peer_timeout_s))
    return {"heartbeat_timeout_seconds": backstop, "shutdown_timeout_seconds": backstop}


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    peer_timeout_s: float = 0.0,
) -> str | None:
    """Join the other processes, when there are any. Returns how ('flags', the detected
    variable) or None for a single-process run.

    Given flags must be complete: all three, or none (then a cluster is auto-detected).
    `peer_timeout_s` is `training.peer_timeout_seconds` (`jax_timeouts`).
    """
    given = {
        "--coordinator_address": coordinator_address,
        "--num_processes": num_processes,
        "--process_id": process_id,
    }
    if any(v is not None for v in given.values()):
        missing = [k for k, v in given.items() if v is None]
        if missing:
            raise UsageError(
                f"several processes need all of --coordinator_address, --num_processes and "
                f"--process_id; missing {', '.join(missing)}"
            )
        if num_processes < 1 or not 0 <= process_id < num_processes:
            raise UsageError(
                f"--process_id={process_id} must be in [0, --num_processes={num_processes})"
            )
        _join(
            peer_timeout_s,
            coordinator_address=coordinator_address,
            num_processes=num_processes,
            process_id=process_id,
        )
        return "flags"
    cluster = detected_cluster()
    if cluster is not None:
        _join(peer_timeout_s)  # JAX reads the cluster's variables itself
    return cluster


def _join(peer_timeout_s: float, **where) -> None:
    # JAX's preemption service would catch SIGTERM in C++ from here on, only to record it for
    # `reached_preemption_sync_point`, which nothing here asks: a SIGTERM before the training
    # loop's own handler is installed (nnx_zoo/runtime/preemption.py) would be swallowed and the
    # process run on until killed. Without it, such a SIGTERM ends the process.
    jax.config.update("jax_enable_preemption_service", False)
    jax.distributed.initialize(**where, **jax_timeouts(peer_timeout_s))
    if not where and slurm_one_task_per_node():
        # From Slurm's variables JAX makes each task see one GPU (its SLURM_LOCALID), as if
        # a task ran per GPU; a task per host owns all of them (the CUDA_VISIBLE_DEVICES
        # Slurm sets still applies). Before any backend starts, so it takes effect.
        jax.config.update("jax_cuda_visible_devices", "all")
        jax.config.update("jax_rocm_visible_devices", "all")


def slurm_one_task_per_node() -> bool:
    """Inside a Slurm step that runs one task on every node (`--ntasks-per-node=1`)."""
    if "SLURM_JOB_ID" not in os.environ:
        return False
    per_node = os.environ.get("SLURM_STEP_TASKS_PER_NODE", "")  # e.g. '1(x4)' or '8,8'
    counts = re.findall(r"(\d+)(?:\(x\d+\))?", per_node)
    return bool(counts) and all(c == "1" for c in counts)


def to_global(local_batch: Mapping[str, np.ndarray], mesh, batch_spec: P) -> dict[str, jax.Array]:
    """Each process's rows -> one global array per key, laid out as `batch_spec` on `mesh`.

    Process p's rows become the rows of the devices it owns, in device order: with the batch
    split over `data`, the global batch is the processes' local batches concatenated.
    """
    n = jax.process_count()
    if n > 1 and batch_spec[0] is None:
        # Each process hands over only its own block of the global batch's rows
        # (nnx_zoo/data/pipeline.py), which a batch layout not split over processes cannot use.
        raise ValueError(f"batch layout {batch_spec} is not split over processes")
    out = {}
    for name, local in local_batch.items():
        global_shape = (local.shape[0] * n, *local.shape[1:])
        # A per-row array ([B]: a mixture's source ids) takes the rows' split alone.
        sharding = NamedSharding(mesh, P(*batch_spec[: local.ndim]))
        out[name] = jax.make_array_from_process_local_data(sharding, local, global_shape)
    return out
