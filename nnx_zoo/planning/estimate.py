"""The step-time model: how long one training step should take on a target, from first
principles, never from XLA's cost model (which counts a scanned layer once and can return
negative or no times).

    compute  = quantized FLOPs / chip peak at model.quantization's precision
               + the other executed FLOPs per device / chip peak bf16 FLOP/s
    executed = model FLOPs (the config's formula: 6 * matmul params + causal attention, per
               token, times the step's tokens; for DPO one more forward of every token,
               the frozen reference's: 2 * matmul params + the attention forward, a third of
               the formula, with LoRA too, the base without adapters being a forward as
               large; ORPO and SimPO have no reference. A pair's two sequences are packed
               side by side in the batch's rows, so the step's tokens already count both)
               + what rematerialisation recomputes:
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
    step     = compute + comm over `model` / `context` / `stage` only
               + max(0, other comm - compute)

Pipeline strategies (a `stage` axis, S stages, Mb micro-batches, R repeats): every stage runs
all Mb*R + S - 1 iterations of the schedule, S - 1 of them on no real work (the bubble,
(S-1)/(Mb*R + S-1) of the layer time), so the layers' executed FLOPs are their share times
(Mb*R + S-1)/(Mb*R); the LM head and embedding run once, each stage on its own rows (the
batch is split over `stage` outside the layer stack), so the head's FLOPs count once. MFU
counts the useful FLOPs only (the config's formula), so the bubble lowers it.

The overlap assumption, stated: collectives whose group spans a data-parallel axis (`data`,
`replica`: FSDP weight all-gathers, gradient reduce-scatters / all-reduces, also when XLA
fuses them across `data` and `model` at once) are issued asynchronously and hide behind the
layer compute of neighbouring layers, so they cost time only where they exceed the compute;
collectives that cross only tensor / context-parallel axes (`model`, `context`) move
activations between a matmul and the next one that needs its result, so they are fully
exposed. Compute is taken at the chip's peak: no
allowance for elementwise work or memory-bound kernels, so the bound's MFU is an upper bound
that real runs fall short of. Plans report it as `bound_*`; `predicted_*` is the forecast below
where there is one (`predicted_from` says which).

Axis bandwidth. TPU: a ring along a mesh axis uses the ICI links of every physical torus dim
the axis spans, both directions on a dim that wraps around, one otherwise. GPU: NVLink within
a host, InfiniBand when the group spans hosts (one NIC per GPU). Collectives over several axes
take the bandwidth of the group's devices together.

The forecast (`forecast_step`): what a real step spends, beside the bound above. Every number
in it is an assumption, stated here and in the tables below:

    matmul    = executed matmul FLOPs / (peak * MATMUL_EFFICIENCY[chip](narrowest dim)), the
                fp8 / int8 ones at that precision's peak and QUANTIZED_EFFICIENCY_RATIO times
                the efficiency
    attention = executed attention FLOPs / (peak * FLASH_EFFICIENCY[chip](head dim)) where a
                flash kernel runs (its backward recomputes the scores: 2.5x the forward where
                the bound counts 2x); without one, the score/value einsums are matmuls at the
                efficiency of their narrowest dim (the head dim) and their softmax is memory
                traffic below
    memory    = bytes of the memory-bound kernels / (HBM bandwidth * HBM_EFFICIENCY): norms,
                rotary, softmax outside flash, the SwiGLU product, the loss, the optimizer
                update, copies. The bytes come from the compiled HLO of the same step with one
                and with two unrolled layers (`planning.hlo_traffic`): one layer's share times
                L plus the rest (embedding, head, loss, optimizer), so a scan's stacking does
                not count
    host      = kernels per step * KERNEL_GAP_SECONDS[platform]: the launch gap between
                kernels that the device idles through (GPU). Per-step host work (dispatch,
                the next batch) overlaps the device under asynchronous dispatch and is not
                counted; metrics.jsonl's `data_wait_time` shows where it does not
    step      = matmul + attention + memory + host + exposed comm
                + max(0, overlapped comm - (matmul + attention + memory))

Matmuls, flash kernels and memory-bound kernels run one after another (a GPU runs one kernel
at a time; TPU fuses elementwise work into matmul outputs, whose bytes then hide, so that work
is not in the memory term). The bound is the forecast with every efficiency at 1 and no
memory or host term; the forecast is never below it.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from nnx_zoo.errors import UsageError
from nnx_zoo.planning.chips import Chip, peak_flops
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
    mfu: float  # model FLOPs / (bf16 peak * step)
    mfu_at_precision: float  # model FLOPs / (peak at model.quantization's precision * step)
    quantized_flops: float = 0.0  # per device per step: executed in fp8 / int8
    bubble: float = 0.0  # pipeline strategies: idle fraction of each stage's layer time


# Matmul efficiency: achieved / peak bf16 FLOP/s for the step's large matmuls, by the narrowest
# of their dims on a device (rows = tokens per device, hidden dim, FFN and head dims after
# tensor parallelism): (at least this wide, efficiency), widest first. Assumptions, with the
# evidence behind them:
# - GPU (H100/H200 SXM, XLA's cuBLAS / Triton GEMMs): cuBLAS bf16 on H100 SXM reaches about
#   700-750 TFLOP/s (0.71-0.76 of 989) on 8192-wide square GEMMs and falls off below 4096
#   (NVIDIA's cuBLAS 12 release notes and the FlashAttention-3 paper's GEMM baseline, arXiv
#   2407.08608); sustained clocks under the 700 W limit take a few % more.
# - TPU v5p / v5e (128x128 MXUs): MaxText's published 65.4% end-to-end MFU for Llama 2 70B on
#   v5p (M=8192) needs matmuls at >= 0.8 of peak; narrower dims fill the MXU less well.
# - TPU v6e (256x256 MXUs): the same falloff one width step earlier (a 256-wide systolic
#   array needs twice the width to fill).
MATMUL_EFFICIENCY: dict[str, tuple[tuple[int, float], ...]] = {
    "gpu": ((8192, 0.72), (4096, 0.68), (2048, 0.62), (1024, 0.50), (0, 0.35)),
    "v5p": ((8192, 0.85), (4096, 0.80), (2048, 0.70), (1024, 0.60), (0, 0.40)),
    "v5e": ((8192, 0.85), (4096, 0.80), (2048, 0.70), (1024, 0.60), (0, 0.40)),
    "v6e": ((8192, 0.80), (4096, 0.72), (2048, 0.60), (1024, 0.45), (0, 0.30)),
}
# Flash attention: executed FLOPs (forward + the backward with its recompute) / peak, by head
# dim (at least, efficiency). GPU: cuDNN's fused attention on H100 runs its forward at about
# 0.55-0.75 of peak for head dim 128 on long rows and its backward at about 0.4-0.5
# (FlashAttention-3 paper, arXiv 2407.08608, which compares cuDNN 9); at 2048-token causal rows
# and head dim 64 it is well below that. TPU: the Pallas splash kernel, assumed the same as
# cuDNN (no published per-kernel figure found).
FLASH_EFFICIENCY: dict[str, tuple[tuple[int, float], ...]] = {
    "gpu": ((128, 0.45), (0, 0.30)),
    "tpu": ((128, 0.45), (0, 0.30)),
}
# Quantized matmuls' efficiency as a share of the bf16 efficiency above, by platform: what the
# fp8 / int8 GEMMs reach of their own peak is less than bf16 GEMMs reach of theirs (per-tensor
# scaling, narrower tiles, XLA's Triton fp8 GEMMs). GPU: calibrated on the one measured row,
# llama3_1b 8 x 2048 fp8 on an H200 (issue 36: 0.288 s with Triton GEMMs, 0.281 s with
# cuBLASLt, against the bf16 step's 0.321 s): at 1.0 the forecast was 0.236 s (18% under);
# 0.6 (fp8 GEMMs at 0.37 of the fp8 peak, 1.2x the bf16 GEMMs' rate) gives 0.288 s. TPU:
# unmeasured, left at 1.0.
QUANTIZED_EFFICIENCY_RATIO = {"gpu": 0.6, "tpu": 1.0}
# Share of the vendor's HBM bandwidth a streaming kernel achieves (STREAM-like copies reach
# 0.85-0.92 on H100 and TPU v5p; fused elementwise kernels with reductions a little less).
HBM_EFFICIENCY = 0.85
# Idle device time per kernel launched: GPU kernels launch back to back with a gap of a few
# microseconds (less inside CUDA graphs, which XLA uses for runs of fusions); a TPU runs the
# whole program on the chip's own sequencer, its per-op overhead is in the efficiencies.
KERNEL_GAP_SECONDS = {"gpu": 2e-6, "tpu": 0.0}


def _lookup(table, width: float) -> float:
    for at_least, value in table:
        if width >= at_least:
            return value
    return table[-1][1]


def matmul_efficiency(chip: Chip, narrowest_dim: float) -> float:
    """The assumed share of peak for matmuls whose narrowest per-device dim is this."""
    key = chip.platform if chip.platform == "gpu" else _chip_key(chip)
    return _lookup(MATMUL_EFFICIENCY[key], narrowest_dim)


def flash_efficiency(chip: Chip, head_dim: int) -> float:
    return _lookup(FLASH_EFFICIENCY[chip.platform], head_dim)


def _chip_key(chip: Chip) -> str:
    for key in ("v5p", "v5e", "v6e"):
        if key in chip.name.lower().replace("tpu ", ""):
            return key
    raise ValueError(f"no matmul efficiency for {chip.name}")


def reference_flops_per_token(cfg, seq_len: int, reference: bool) -> float:
    """FLOPs per token of a frozen reference's forward (DPO): a third of the training
    formula (2 of its 6 FLOPs per weight, the attention forward of its 3x); 0 without one.
    No backward and no remat: its log probabilities are constants to the loss's gradient."""
    return cfg.flops_per_token(seq_len) / 3.0 if reference else 0.0


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
        raise UsageError(f"remat={remat!r}; valid: none, dots, {', '.join(kept)}")
    return block_matmuls_forward - kept[remat] + attention_forward


def quantized_flops_per_token(cfg, remat: str, reference: bool = False) -> float:
    """Executed FLOPs per token of the projections `cfg.quantization` quantizes: q/k/v/o and
    the dense MLP (not MoE experts), 6 FLOPs per weight for training plus 2 per weight that
    `remat` recomputes (as `recompute_flops_per_token` counts it) and 2 per weight for a
    reference's forward (`reference_flops_per_token`)."""
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
    return L * ((8.0 if reference else 6.0) * per_layer + 2.0 * recomputed)


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
    reference: bool = False,
) -> StepEstimate:
    """`pipeline`: the schedule (zoo.layers.pipeline.PipelinePlan) of a pipeline strategy;
    `reference`: the objective runs a frozen reference's forward (DPO), model FLOPs too (work
    the objective needs, not the implementation's choice, as remat is)."""
    tokens = global_batch * seq_len
    per_token = cfg.flops_per_token(seq_len) + reference_flops_per_token(cfg, seq_len, reference)
    model = per_token * tokens / num_devices
    executed = model + recompute_flops_per_token(cfg, seq_len, remat) * tokens / num_devices
    bubble = 0.0
    if pipeline is not None:
        bubble = pipeline.bubble
        # The layers run every iteration, bubble included; the LM head runs once, on each
        # stage's own rows (zoo/layers/pipeline.py), or under 1F1B on every row's on one
        # stage (`head_factor`: S, zoo/layers/pipeline_1f1b.py).
        head = (8.0 if reference else 6.0) * cfg.hidden_dim * cfg.vocab_size
        head *= tokens / num_devices
        work = pipeline.microbatches * pipeline.repeats
        executed = (executed - head) * pipeline.iterations / work + head * pipeline.head_factor
    quantized = quantized_flops_per_token(cfg, remat, reference) * tokens / num_devices
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
        bubble=bubble,
    )


def compute_lower_bound(
    cfg, *, seq_len, global_batch, num_devices, remat, chip, pipeline=None, reference=False
) -> float:
    """Seconds no candidate with this remat (and pipeline schedule) can beat: its compute
    alone, a pipeline's bubble included."""
    return estimate_step(
        cfg,
        seq_len=seq_len,
        global_batch=global_batch,
        num_devices=num_devices,
        remat=remat,
        chip=chip,
        exposed_comm=0.0,
        overlapped_comm=0.0,
        pipeline=pipeline,
        reference=reference,
    ).step_seconds


@dataclasses.dataclass(frozen=True)
class Forecast:
    """What a real step should take (see the module doc), per device, term by term."""

    matmul_flops: float  # executed, outside attention
    attention_flops: float  # executed by attention (flash kernels' recompute included)
    matmul_efficiency: float
    attention_efficiency: float
    matmul_seconds: float
    attention_seconds: float
    memory_bytes: float  # memory-bound kernels' HBM traffic
    memory_seconds: float
    kernels: float  # kernels launched per step
    host_seconds: float
    exposed_comm_seconds: float
    overlapped_comm_seconds: float
    step_seconds: float
    mfu: float  # model FLOPs / (bf16 peak * step)
    mfu_at_precision: float  # model FLOPs / (peak at model.quantization's precision * step)

    def to_json(self) -> dict:
        return {f"forecast_{k}": v for k, v in dataclasses.asdict(self).items()}


def attention_forward_flops_per_token(cfg, seq_len: int) -> float:
    """Forward score + value products per token over all layers: 4 * N * D per key seen."""
    total = 0.0
    for window in cfg.layer_windows():
        total += 4.0 * cfg.num_heads * cfg.head_dim * causal_keys_per_query(seq_len, window or None)
    return total


def narrowest_matmul_dim(cfg, tokens_per_device: int, tensor_parallel: int) -> float:
    """The narrowest dim of the layer matmuls on one device: rows (tokens), the hidden dim
    (the contraction of every input projection), and the FFN and query-head widths split
    over the tensor-parallel axis."""
    ffn = (cfg.moe_ffn_dim if cfg.is_moe else cfg.ffn_dim) / tensor_parallel
    heads = cfg.num_heads * cfg.head_dim / tensor_parallel
    return min(tokens_per_device, cfg.hidden_dim, ffn, heads)


def forecast_step(
    cfg,
    *,
    seq_len: int,
    global_batch: int,
    num_devices: int,
    micro_batches: int,
    tensor_parallel: int,
    remat: str,
    chip: Chip,
    flash: bool,
    memory_bytes: float,
    kernels: float,
    exposed_comm: float,
    overlapped_comm: float,
    pipeline=None,
    reference: bool = False,
) -> Forecast | None:
    """The forecast for one step; None for a chip without the figures (the simulated CPU).

    `pipeline` (a PipelinePlan): each device runs its stage's layers on one micro-batch of
    its rows at a time, every one of the schedule's Mb*R + S-1 iterations (bubble included:
    SPMD stages compute on stale values there), so the layers' matmul, attention and
    memory-bound time stretch by iterations / (Mb*R); the LM head runs once, on the stage's
    own rows (1F1B: S times that, `PipelinePlan.head_factor`). `memory_bytes` is then the
    in-stage twin's (planning.forecast._in_stage). `reference`: one more forward of every
    token (DPO's frozen reference, `reference_flops_per_token`): its matmuls and its
    attention forward join those terms, and the model FLOPs (as `estimate_step` counts)."""
    if chip.hbm_bytes_per_s is None or chip.platform not in KERNEL_GAP_SECONDS:
        return None
    tokens = global_batch * seq_len
    per_device = tokens / num_devices
    attention_fwd = attention_forward_flops_per_token(cfg, seq_len)
    recompute = recompute_flops_per_token(cfg, seq_len, remat)
    # What remat recomputes of attention: its forward, under every policy but `none`.
    attention_recompute = attention_fwd if remat != "none" else 0.0
    # Forward, backward (2x; a flash kernel's backward recomputes the scores: 2.5x), remat.
    attention = attention_fwd * (3.5 if flash else 3.0) + attention_recompute
    reference_fwd = reference_flops_per_token(cfg, seq_len, reference)
    attention += attention_fwd if reference else 0.0
    model_per_token = cfg.flops_per_token(seq_len) + reference_fwd
    matmul = model_per_token - 3.0 * attention_fwd + recompute - attention_recompute
    matmul -= attention_fwd if reference else 0.0
    matmul_flops, attention_flops = matmul * per_device, attention * per_device
    # Rows a device's matmuls see: its data shard of one micro-batch (tensor parallelism
    # splits the weights, not the rows).
    rows = per_device * tensor_parallel / micro_batches
    stretch, head_share, head_factor, launches = 1.0, 0.0, 1, 1.0
    if pipeline is not None:
        head_factor = pipeline.head_factor
        rows *= pipeline.stages / pipeline.microbatches
        stretch = pipeline.iterations / (pipeline.microbatches * pipeline.repeats)
        head_share = (8.0 if reference else 6.0) * cfg.hidden_dim * cfg.vocab_size / matmul
        # A stage launches its L/(S*R) layers' kernels once per iteration.
        launches = pipeline.iterations / (pipeline.stages * pipeline.repeats)
    m_eff = matmul_efficiency(chip, narrowest_matmul_dim(cfg, rows, tensor_parallel))
    a_eff = flash_efficiency(chip, cfg.head_dim) if flash else matmul_efficiency(chip, cfg.head_dim)
    # The projections model.quantization runs in fp8 / int8 go at that precision's peak, at a
    # lower efficiency (QUANTIZED_EFFICIENCY_RATIO).
    quantized = quantized_flops_per_token(cfg, remat, reference) * per_device
    peak_low = peak_flops(chip, getattr(cfg, "quantization", "none"))
    q_eff = m_eff * QUANTIZED_EFFICIENCY_RATIO.get(chip.platform, 1.0) if quantized else m_eff
    matmul_s = (matmul_flops - quantized) / (chip.peak_bf16_flops * m_eff) + quantized / (
        peak_low * q_eff
    )
    attention_s = attention_flops / (chip.peak_bf16_flops * a_eff)
    memory_s = memory_bytes / (chip.hbm_bytes_per_s * HBM_EFFICIENCY)
    # The layers' share stretches over the bubble, the head's does not (1F1B: it runs S
    # times a device's share). Memory-bound time all stretches: the optimizer's share, which
    # runs once, is over-counted by the bubble.
    matmul_s *= head_share * head_factor + (1.0 - head_share) * stretch
    attention_s *= stretch
    memory_s *= stretch
    host_s = kernels * launches * KERNEL_GAP_SECONDS[chip.platform]
    busy = matmul_s + attention_s + memory_s
    step = busy + host_s + exposed_comm + max(0.0, overlapped_comm - busy)
    return Forecast(
        matmul_flops=matmul_flops,
        attention_flops=attention_flops,
        matmul_efficiency=m_eff,
        attention_efficiency=a_eff,
        matmul_seconds=matmul_s,
        attention_seconds=attention_s,
        memory_bytes=memory_bytes,
        memory_seconds=memory_s,
        kernels=kernels,
        host_seconds=host_s,
        exposed_comm_seconds=exposed_comm,
        overlapped_comm_seconds=overlapped_comm,
        step_seconds=step,
        mfu=model_per_token * per_device / (chip.peak_bf16_flops * step),
        mfu_at_precision=model_per_token * per_device / (peak_low * step),
    )
