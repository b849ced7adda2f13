"""The step-time model: how long one training step should take on a target, from first
principles, never from XLA's cost model (which counts a scanned layer once and can return
negative or no times).

    compute  = executed FLOPs per device / chip peak bf16 FLOP/s
    executed = model FLOPs (the config's formula: 6 * matmul params + causal attention, per
               token, times the step's tokens) + what rematerialisation recomputes:
                 remat 'full': every block's forward pass again (its matmuls and attention);
                 remat 'dots': the attention score/value products (they have batch dims, so
                   the policy does not save them); the projections are saved;
                 remat 'none': nothing.
    comm(op) = executions per step * bytes a device sends (ring algorithm: (n-1)/n of the
               array for all-gather / reduce-scatter / all-to-all, twice that for all-reduce,
               the operand for a permute) / bandwidth of the mesh axes the op crosses.
    step     = compute + comm over `model` / `context` / `stage` only
               + max(0, other comm - compute)

Pipeline strategies (a `stage` axis, S stages, Mb micro-batches, R repeats): every stage runs
all Mb*R + S - 1 iterations of the schedule, S - 1 of them on no real work (the bubble,
(S-1)/(Mb*R + S-1) of the layer time), so the layers' executed FLOPs are their share times
(Mb*R + S-1)/(Mb*R); the LM head and embedding run on every stage (each stage runs the head
on its data shard's whole batch), so the head's FLOPs count S times. MFU counts the useful
FLOPs only (the config's formula), so the bubble and the repeated head lower it.

The overlap assumption, stated: collectives whose group spans a data-parallel axis (`data`,
`replica`: FSDP weight all-gathers, gradient reduce-scatters / all-reduces, also when XLA
fuses them across `data` and `model` at once) are issued asynchronously and hide behind the
layer compute of neighbouring layers, so they cost time only where they exceed the compute;
collectives that cross only tensor / context-parallel axes (`model`, `context`) move
activations between a matmul and the next one that needs its result, so they are fully
exposed. Compute is taken at the chip's peak: no
allowance for elementwise work, memory-bound kernels or pipeline bubbles, so the predicted
MFU is an upper bound that real runs fall short of.

Axis bandwidth. TPU: a ring along a mesh axis uses the ICI links of every physical torus dim
the axis spans, both directions on a dim that wraps around, one otherwise. GPU: NVLink within
a host, InfiniBand when the group spans hosts (one NIC per GPU). Collectives over several axes
take the bandwidth of the group's devices together.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from planning.chips import Chip
from shardings.hlo import Collective
from zoo.layers.config import causal_keys_per_query

# Collectives crossing these are exposed (see the overlap assumption): tensor parallelism,
# context parallelism's exchanges of keys and values inside attention, and the pipeline's
# stage-to-stage permutes (the next stage waits for them).
TP_AXES = ("model", "context", "stage")


@dataclasses.dataclass(frozen=True)
class StepEstimate:
    model_flops: float  # per device per step: the config's formula
    executed_flops: float  # per device per step: model FLOPs + rematerialisation
    compute_seconds: float
    exposed_comm_seconds: float  # tensor-parallel collectives
    overlapped_comm_seconds: float  # data-parallel collectives, hidden behind compute
    step_seconds: float
    mfu: float  # model FLOPs / (peak * step)
    bubble: float = 0.0  # pipeline strategies: idle fraction of each stage's layer time


def recompute_flops_per_token(cfg, seq_len: int, remat: str) -> float:
    """FLOPs per token that rematerialisation adds to the config's training FLOPs.

    Training FLOPs are 3x the forward (forward + backward 2x); a block's forward is then 1/3
    of its training FLOPs, and the LM head is outside the remat'd blocks. What each policy
    keeps (zoo/layers/remat.py) is not recomputed: `dots` keeps every projection (the
    attention einsums have batch dims and are recomputed), `save_qkv_proj` / `save_out_proj`
    keep those projections, `offload` keeps only the residual stream (in host memory), as
    `full` keeps only the scan's carry: both recompute every matmul of the block.
    """
    if remat == "none":
        return 0.0
    M, N, K, D = cfg.hidden_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    attention_forward = 0.0
    for window in cfg.layer_windows():
        attention_forward += 4.0 * N * D * causal_keys_per_query(seq_len, window or None)
    if remat == "dots":
        return attention_forward
    # matmul_params counts the head at the true vocabulary size: take that term back out.
    block_matmuls_forward = 2.0 * (cfg.matmul_params() - M * cfg.vocab_size)
    kept = {
        "full": 0.0,
        "offload": 0.0,
        "save_qkv_proj": 2.0 * cfg.num_layers * M * D * (N + 2 * K),
        "save_out_proj": 2.0 * cfg.num_layers * N * D * M,
    }
    if remat not in kept:
        raise ValueError(f"remat={remat!r}; valid: none, dots, {', '.join(kept)}")
    return block_matmuls_forward - kept[remat] + attention_forward


def axis_bandwidth(devices_grid: np.ndarray, axis_index: tuple[int, ...], chip: Chip, dims=None):
    """Bytes/s one device can send along the mesh axes `axis_index` of `devices_grid`.

    `dims` is the TPU slice's physical shape (e.g. (4, 4, 4)), for wraparound; the devices'
    `coords` say which physical dims the axes span.
    """
    # The group of devices that varies along these axes, others fixed at index 0.
    index = tuple(slice(None) if i in axis_index else 0 for i in range(devices_grid.ndim))
    group = np.asarray(devices_grid[index]).reshape(-1)
    if len(group) <= 1:
        return math.inf
    if chip.platform == "tpu" and all(hasattr(d, "coords") for d in group):
        coords = np.array([tuple(d.coords) for d in group])
        total = 0.0
        for dim in range(coords.shape[1]):
            if len(set(coords[:, dim].tolist())) <= 1:
                continue
            size = dims[dim] if dims is not None and dim < len(dims) else 0
            wraps = bool(chip.wraparound_dim and size and size % chip.wraparound_dim == 0)
            total += chip.link_bytes_per_s * (2 if wraps else 1)
        return total or chip.link_bytes_per_s
    if chip.platform == "gpu":
        hosts = {_host(d, chip) for d in group}
        if len(hosts) > 1 and chip.cross_host_bytes_per_s:
            return chip.cross_host_bytes_per_s
    return chip.link_bytes_per_s


def _host(device, chip: Chip) -> int:
    # Abstract target devices carry a process index per host; a plain id says the same.
    index = getattr(device, "process_index", None)
    return index if index is not None else device.id // chip.devices_per_host


def comm_seconds(
    ops: list[Collective], bandwidth_of, axis_names: tuple[str, ...]
) -> tuple[float, float]:
    """(exposed, overlappable) seconds per step; `bandwidth_of(axis_indices)` -> bytes/s."""
    exposed = overlapped = 0.0
    for op in ops:
        if not op.axes:
            continue
        seconds = (
            op.executions
            * op.bytes_per_device
            / bandwidth_of(tuple(axis_names.index(a) for a in op.axes))
        )
        if all(a in TP_AXES for a in op.axes):
            exposed += seconds
        else:
            overlapped += seconds
    return exposed, overlapped


def estimate_step(
    cfg,
    *,
    seq_len: int,
    global_batch: int,
    num_devices: int,
    remat: str,
    chip: Chip,
    exposed_comm: float,
    overlapped_comm: float,
    pipeline=None,
) -> StepEstimate:
    """`pipeline`: the schedule (zoo.layers.pipeline.PipelinePlan) of a pipeline strategy."""
    tokens = global_batch * seq_len
    model = cfg.flops_per_token(seq_len) * tokens / num_devices
    executed = model + recompute_flops_per_token(cfg, seq_len, remat) * tokens / num_devices
    bubble = 0.0
    if pipeline is not None:
        bubble = pipeline.bubble
        head = 6.0 * cfg.hidden_dim * cfg.vocab_size * tokens / num_devices
        work = pipeline.microbatches * pipeline.repeats
        executed = (executed - head) * pipeline.iterations / work + head * pipeline.stages
    compute = executed / chip.peak_bf16_flops
    step = compute + exposed_comm + max(0.0, overlapped_comm - compute)
    return StepEstimate(
        model_flops=model,
        executed_flops=executed,
        compute_seconds=compute,
        exposed_comm_seconds=exposed_comm,
        overlapped_comm_seconds=overlapped_comm,
        step_seconds=step,
        mfu=model / (chip.peak_bf16_flops * step),
        bubble=bubble,
    )


def compute_lower_bound(cfg, *, seq_len, global_batch, num_devices, remat, chip) -> float:
    """Seconds no candidate with this remat can beat: its compute alone."""
    return estimate_step(
        cfg,
        seq_len=seq_len,
        global_batch=global_batch,
        num_devices=num_devices,
        remat=remat,
        chip=chip,
        exposed_comm=0.0,
        overlapped_comm=0.0,
    ).step_seconds
