"""The step-time model: how long one training step should take on a target, from first
principles, never from XLA's cost model (which counts a scanned layer once and can return
negative or no times).

    compute  = quantized FLOPs / chip peak at model.quantization's precision
               + the other executed FLOPs per device / chip peak bf16 FLOP/s
    executed = model FLOPs (the config's formula: 6 * matmul params + causal attention, per
               token, times the step's tokens) + what rematerialisation recomputes:
                 remat 'full': every block's forward pass again (its matmuls and attention);
                 remat 'dots': the attention score/value products (they have batch dims, so
                   the policy does not save them); the projections are saved;
                 remat 'none': nothing.
    quantized = the executed FLOPs of the projections model.quantization runs in fp8 / int8
               (q, k, v, o and the dense MLP, forward, backward and recomputed); the LM
               head, the attention core and MoE experts stay at the bf16 rate.
    mfu      = model FLOPs / (bf16 peak * step), the published convention;
    mfu_at_precision = model FLOPs / (peak at the quantization's precision * step), so the
               share of the faster peak reached (below 1 even at best: head and attention
               run at the bf16 rate).
    comm(op) = executions per step * bytes a device sends (ring algorithm: (n-1)/n of the
               array for all-gather / reduce-scatter / all-to-all, twice that for all-reduce,
               the operand for a permute) / bandwidth of the mesh axes the op crosses.
    step     = compute + comm over `model` / `context` only + max(0, other comm - compute)

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

from planning.chips import Chip, peak_flops
from shardings.hlo import Collective
from zoo.layers.config import causal_keys_per_query

# Collectives crossing these are exposed (see the overlap assumption): tensor parallelism, and
# context parallelism's exchanges of keys and values inside attention.
TP_AXES = ("model", "context")


@dataclasses.dataclass(frozen=True)
class StepEstimate:
    model_flops: float  # per device per step: the config's formula
    executed_flops: float  # per device per step: model FLOPs + rematerialisation
    compute_seconds: float
    exposed_comm_seconds: float  # tensor-parallel collectives
    overlapped_comm_seconds: float  # data-parallel collectives, hidden behind compute
    step_seconds: float
    mfu: float  # model FLOPs / (bf16 peak * step)
    mfu_at_precision: float  # model FLOPs / (peak at model.quantization's precision * step)
    quantized_flops: float = 0.0  # per device per step: executed in fp8 / int8


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


def quantized_flops_per_token(cfg, remat: str) -> float:
    """Executed FLOPs per token of the projections `cfg.quantization` quantizes: q/k/v/o and
    the dense MLP (not MoE experts), 6 FLOPs per weight for training plus 2 per weight that
    `remat` recomputes (as `recompute_flops_per_token` counts it)."""
    if getattr(cfg, "quantization", "none") == "none":
        return 0.0
    M, N, K, D, L = cfg.hidden_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers
    qkv, out = M * D * (N + 2 * K), N * D * M
    mlp = 0 if cfg.is_moe else M * cfg.ffn_dim * (3 if cfg.glu else 2)
    per_layer = qkv + out + mlp
    recomputed = {
        "none": 0,
        "dots": 0,
        "full": per_layer,
        "offload": per_layer,
        "save_qkv_proj": per_layer - qkv,
        "save_out_proj": per_layer - out,
    }[remat]
    return L * (6.0 * per_layer + 2.0 * recomputed)


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
) -> StepEstimate:
    tokens = global_batch * seq_len
    model = cfg.flops_per_token(seq_len) * tokens / num_devices
    executed = model + recompute_flops_per_token(cfg, seq_len, remat) * tokens / num_devices
    quantized = quantized_flops_per_token(cfg, remat) * tokens / num_devices
    peak_low = peak_flops(chip, getattr(cfg, "quantization", "none"))
    compute = (executed - quantized) / chip.peak_bf16_flops + quantized / peak_low
    step = compute + exposed_comm + max(0.0, overlapped_comm - compute)
    return StepEstimate(
        model_flops=model,
        executed_flops=executed,
        compute_seconds=compute,
        exposed_comm_seconds=exposed_comm,
        overlapped_comm_seconds=overlapped_comm,
        step_seconds=step,
        mfu=model / (chip.peak_bf16_flops * step),
        mfu_at_precision=model / (peak_low * step),
        quantized_flops=quantized,
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
