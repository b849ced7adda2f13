"""Pipeline parallelism over the `stage` mesh axis: GPipe and circular schedules, one loop.

The stacked layer weights `[L, ...]` are stored split on L over `stage` (the strategy's
`layers` rule), so stage s holds layers s*L/S .. (s+1)*L/S - 1 and the global arrays are the
ones every other strategy stores (checkpoints move between them unchanged).

Schedule. The batch is cut into `Mb` micro-batches (rows i*Mb + m form micro-batch m, so
each data shard cuts its own rows). `R` repeats (virtual stages per device): layer chunk
c = r*S + s of `Lc = L / (S*R)` layers runs on stage s in repeat r, i.e. with one layer per
chunk, layer l on stage l mod S. R = 1 is GPipe; R > 1 is the circular (interleaved)
schedule, whose bubble is R times smaller. At iteration t stage s works on item k = t - s
(micro-batch k mod Mb, repeat k // Mb) when 0 <= k < Mb*R; there are Mb*R + S - 1
iterations, so the bubble (idle fraction of each stage) is (S-1) / (Mb*R + S-1).

Data movement, inside `jax.shard_map` manual over `stage` only (`data` / `model` stay
explicit, so the blocks run their usual typed layouts): after each iteration every stage
hands its output to the next with one `ppermute` (a collective-permute over `stage`; the
last stage's goes round to stage 0). Stage 0 keeps a buffer of Mb micro-batches: it starts
as the embedded inputs, and each result arriving from the last stage is written back into
it, where repeat r+1 of that micro-batch reads it Mb - S + 1 >= 1 iterations later (hence
Mb >= S). After the last iteration stage 0's buffer holds the outputs, which one sum over
`stage` (stage 0's buffer, zeros elsewhere) hands to the LM head.

As in MaxText's circular pipeline (layers/pipeline.py), every stage runs every iteration
(SPMD): bubble iterations compute on stale values whose results are never stored.
Memory is GPipe's: the backward pass keeps every iteration's activations (per block, what
the model's remat policy saves). Not done: a 1F1B schedule, whose activation memory is bounded
by the stages in flight. Under jax.grad the backward loop runs only after the whole forward
loop, so it needs a custom VJP around this loop that runs forward and backward items in one
loop (each iteration: one micro-batch forward, one backward with `jax.vjp` of the stage
work, the weight gradients accumulated in the carry), and the loss and LM head moved inside
the pipeline's last stage so the backward of micro-batch m can start before micro-batch m+1's
forward ends.

Besides the permutes, `stage` carries the sum that hands stage 0's outputs to every stage
(and its transpose), and the all-reduce of the replicated embedding / LM head gradients.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from zoo.layers.attention import Segments

# The name the repeat's weight slice carries, so that the remat around a stage's work
# recomputes it (a dynamic slice of weights already resident) instead of keeping one slice
# per iteration for the backward pass.
_STAGE_WEIGHTS = "pipeline_stage_weights"


class PipelinePlan(NamedTuple):
    stages: int  # S, the size of the `stage` mesh axis
    microbatches: int  # Mb
    repeats: int  # R (1: GPipe, > 1: circular)
    layers_per_chunk: int  # Lc = L / (S*R)

    @property
    def iterations(self) -> int:
        return self.microbatches * self.repeats + self.stages - 1

    @property
    def bubble(self) -> float:
        """The idle fraction of each stage's time: (S-1) / (Mb*R + S-1)."""
        return (self.stages - 1) / self.iterations

    @property
    def schedule(self) -> str:
        return "gpipe" if self.repeats == 1 else "circular"


def plan(num_layers: int, stages: int, microbatches: int, repeats: int) -> PipelinePlan:
    """The schedule for these sizes (`microbatches` 0: one per stage), or ValueError with
    one line saying what would be valid."""
    mb = microbatches or stages
    if repeats < 1:
        raise ValueError(f"pipeline_repeats={repeats}; valid: 1 (GPipe) or more (circular)")
    if num_layers % (stages * repeats):
        raise ValueError(
            f"num_layers={num_layers} does not divide by stages x repeats = {stages} x "
            f"{repeats}; choose a stage count and pipeline_repeats whose product divides "
            f"{num_layers}"
        )
    if mb < stages:
        raise ValueError(
            f"pipeline_microbatches={mb} is fewer than the {stages} pipeline stages; use at "
            f"least {stages} (or 0: one per stage)"
        )
    return PipelinePlan(stages, mb, repeats, num_layers // (stages * repeats))


def check_batch(batch_size: int, pp: PipelinePlan, data_shards: int) -> None:
    """Each micro-batch's rows divide over the batch split, else one line."""
    if batch_size % (pp.microbatches * data_shards):
        raise ValueError(
            f"batch size {batch_size} does not cut into {pp.microbatches} pipeline "
            f"micro-batches of rows that divide over the {data_shards}-way batch split; use a "
            f"batch size that is a multiple of {pp.microbatches * data_shards}"
        )


def plan_for(cfg, sharding, mesh) -> PipelinePlan | None:
    """The schedule `cfg` runs on `mesh` under a strategy's `sharding` (an LmSharding), or
    None when the strategy has no stage axis. ValueError (one line) for sizes it cannot run."""
    axis = sharding.stage_axis
    if axis is None:
        return None
    if not cfg.scan_layers:
        raise ValueError("a pipeline strategy splits the stacked layers: set scan_layers=True")
    if cfg.is_moe:
        raise ValueError("MoE layers do not run under a pipeline strategy yet; use fsdp_ep")
    return plan(cfg.num_layers, mesh.shape[axis], cfg.pipeline_microbatches, cfg.pipeline_repeats)


def check_batch_size(batch_size: int, cfg, sharding, mesh) -> None:
    """Rows per forward pass cut into micro-batches that divide over the batch split."""
    pp = plan_for(cfg, sharding, mesh)
    if pp is not None:
        check_batch(batch_size, pp, _shards(sharding.tokens[0], mesh))


def _shards(entry, mesh) -> int:
    axes = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
    return math.prod(mesh.shape[a] for a in axes)


def chunk_order(num_layers: int, stages: int, repeats: int) -> np.ndarray:
    """The layer indices in the order stage-major storage must hold them for the schedule:
    position (s, r, j) holds layer (r*S + s)*Lc + j. The identity for R = 1."""
    lc = num_layers // (stages * repeats)
    layers = np.arange(num_layers).reshape(repeats, stages, lc)
    return layers.transpose(1, 0, 2).reshape(-1)


def _to_schedule_order(w, stage_axis: str, stages: int, repeats: int):
    """A stacked weight `[L/stage, ...]` laid out so that stage s holds its R chunks, in
    repeat order. R = 1: already so (no communication). R > 1: an all-to-all over `stage`
    (the transpose of the gradients is another), the price of circular storage in the
    checkpoint's layer order."""
    if repeats == 1:
        return w
    L, rest = w.shape[0], w.shape[1:]
    spec = tuple(jax.typeof(w).sharding.spec)[1:]
    spec = (*spec, *(None,) * (len(rest) - len(spec)))
    lc = L // (stages * repeats)
    w = jax.sharding.reshard(w, P(None, *spec))
    w = w.reshape(repeats, stages, lc, *rest).swapaxes(0, 1).reshape(L, *rest)
    return jax.sharding.reshard(w, P(stage_axis, *spec))


def _microbatch(a, mb: int):
    """[B, ...] -> [Mb, B/Mb, ...]: rows i*Mb + m form micro-batch m, so a split of B over
    the batch axes lands on B/Mb (each data shard cuts its own rows; no communication)."""
    spec = tuple(jax.typeof(a).sharding.spec)
    spec = (*spec, *(None,) * (a.ndim - len(spec)))
    b = a.shape[0]
    a = a.reshape(b // mb, mb, *a.shape[1:], out_sharding=P(spec[0], None, *spec[1:]))
    return jnp.moveaxis(a, 1, 0)


def _unmicrobatch(a):
    """The inverse of `_microbatch`."""
    spec = tuple(jax.typeof(a).sharding.spec)
    spec = (*spec, *(None,) * (a.ndim - len(spec)))
    a = jnp.moveaxis(a, 0, 1)
    return a.reshape(a.shape[0] * a.shape[1], *a.shape[2:], out_sharding=P(spec[1], *spec[2:]))


def run(model, x_BTM, segments: Segments, windows, freqs_LR, stage_axis: str):
    """The layer stack of `model` (a DecoderLM) as a pipeline over `stage_axis`; returns
    (x_BTM, (None, None)) as `DecoderLM._run_scanned` does (no cache, no router stats)."""
    cfg = model.cfg
    mesh = jax.sharding.get_abstract_mesh()
    pp = plan_for(cfg, model.sharding, mesh)
    S, Mb, R, Lc = pp.stages, pp.microbatches, pp.repeats, pp.layers_per_chunk
    check_batch(x_BTM.shape[0], pp, _shards(tuple(jax.typeof(x_BTM).sharding.spec)[0], mesh))

    # Per-layer tables in schedule order, [S, R, Lc]: stage s, repeat r reads row (s, r).
    order = chunk_order(cfg.num_layers, S, R)
    uniform_window = len(set(windows)) == 1
    static_window = (windows[0] or None) if uniform_window else None
    # Laid out over `stage` before the shard_map: jax >= 0.12 refuses an input whose layout
    # differs from its in_spec rather than resharding it.
    windows_SRL = jax.sharding.reshard(
        jnp.asarray(np.asarray(windows, np.int32)[order].reshape(S, R, Lc)), P(stage_axis)
    )
    freqs_SRLR = jax.sharding.reshard(
        jnp.asarray(np.asarray(freqs_LR)[order].reshape(S, R, Lc, -1)), P(stage_axis)
    )

    # Matmul weights cast to the compute dtype once, before the loop (as the layer scan does).
    graphdef, weights = nnx.split(model._compute_dtype_blocks())
    weights = jax.tree.map(lambda w: _to_schedule_order(w, stage_axis, S, R), weights)

    inputs = _microbatch(x_BTM, Mb)  # [Mb, B/Mb, T, M]
    seg = jax.tree.map(lambda a: _microbatch(a, Mb), segments)

    def stage_work(weights_RL, x, seg_m, r, windows_RL, freqs_RLR):
        """Repeat r's Lc layers of this stage on one micro-batch."""

        def take(w):
            return checkpoint_name(
                jax.lax.dynamic_index_in_dim(w, r, 0, keepdims=False), _STAGE_WEIGHTS
            )

        chunk = jax.tree.map(take, weights_RL)
        windows_L = jax.lax.dynamic_index_in_dim(windows_RL, r, 0, keepdims=False)
        freqs_LR_ = jax.lax.dynamic_index_in_dim(freqs_RLR, r, 0, keepdims=False)

        def layer(x, xs):
            w, window, inv_freq_R = xs
            block = nnx.merge(graphdef, w)
            win = static_window if uniform_window else window
            x, _ = model._call_block(block, x, seg_m, win, inv_freq_R, None)
            return x, None

        x, _ = jax.lax.scan(layer, x, (chunk, windows_L, freqs_LR_))
        return x

    if R > 1:
        stage_work = jax.checkpoint(
            stage_work,
            policy=jax.checkpoint_policies.save_anything_except_these_names(_STAGE_WEIGHTS),
        )

    perm = [(s, (s + 1) % S) for s in range(S)]

    def local(weights, inputs, seg, windows_SRL, freqs_SRLR):
        s = jax.lax.axis_index(stage_axis)
        # Local weights [R*Lc, ...] -> [R, Lc, ...]; local tables [1, R, Lc] -> [R, Lc].
        weights_RL = jax.tree.map(lambda w: w.reshape(R, Lc, *w.shape[1:]), weights)
        windows_RL, freqs_RLR = windows_SRL[0], freqs_SRLR[0]

        def iteration(carry, t):
            buf, state = carry
            k = t - s  # this stage's work item
            m, r = k % Mb, jnp.clip(k // Mb, 0, R - 1)
            x = jnp.where(s == 0, jax.lax.dynamic_index_in_dim(buf, m, 0, keepdims=False), state)
            seg_m = jax.tree.map(
                lambda a: jax.lax.dynamic_index_in_dim(a, m, 0, keepdims=False), seg
            )
            y = stage_work(weights_RL, x, seg_m, r, windows_RL, freqs_RLR)
            # Hand on to the next stage; stage 0 receives the last stage's result of item
            # t - (S-1) and files it under its micro-batch.
            received = jax.lax.ppermute(y, stage_axis, perm)
            k_last = t - (S - 1)
            done = (s == 0) & (k_last >= 0) & (k_last < Mb * R)
            slot = k_last % Mb
            old = jax.lax.dynamic_index_in_dim(buf, slot, 0, keepdims=False)
            buf = jax.lax.dynamic_update_index_in_dim(buf, jnp.where(done, received, old), slot, 0)
            return (buf, received), None

        # Every stage's buffer and state differ (they vary over `stage`).
        buf0 = jax.lax.pcast(inputs, (stage_axis,), to="varying")
        state0 = jnp.zeros_like(buf0[0])
        (buf, _), _ = jax.lax.scan(iteration, (buf0, state0), jnp.arange(pp.iterations))
        # Stage 0 holds the outputs; the others' buffers are zeroed, so the sum hands stage
        # 0's to every stage.
        return jax.lax.psum(jnp.where(s == 0, buf, jnp.zeros_like(buf)), stage_axis)

    w_specs = jax.tree.map(lambda w: P(stage_axis), weights)
    out = jax.shard_map(
        local,
        in_specs=(w_specs, P(), P(), P(stage_axis), P(stage_axis)),
        out_specs=P(),
        axis_names={stage_axis},
    )(weights, inputs, seg, windows_SRL, freqs_SRLR)
    return _unmicrobatch(out), (None, None)
