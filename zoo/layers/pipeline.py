"""Pipeline parallelism over the `stage` mesh axis: GPipe and circular schedules, one loop.
(1F1B: zoo/layers/pipeline_1f1b.py.)

The stacked layer weights `[L, ...]` are stored split on L over `stage` (the strategy's
`layers` rule), so stage s holds layers s*L/S .. (s+1)*L/S - 1 and the global arrays are the
ones every other strategy stores (checkpoints move between them unchanged).

Rows. Outside the layer stack the batch is split over `stage` as well as the batch axes (the
strategy's `batch` rule, `stage` minor-most): each stage embeds, and runs the final norm,
the LM head and the loss on, its own rows, so nothing there runs once per stage. The batch
is cut into `Mb` micro-batches (a multiple of S) such that each stage's rows are Mb/S whole
micro-batches' shares of every data shard (`microbatch`: no communication). Stage k sends
its micro-batches to stage 0 (S-1 collective-permutes), and after the loop stage 0 sends
each stage back its own (S-1 more).

Schedule. `R` repeats (virtual stages per device): layer chunk c = r*S + s of
`Lc = L / (S*R)` layers runs on stage s in repeat r, i.e. with one layer per chunk, layer l
on stage l mod S. R = 1 is GPipe; R > 1 is the circular (interleaved) schedule, whose bubble
is R times smaller. At iteration t stage s works on item k = t - s (micro-batch k mod Mb,
repeat k // Mb) when 0 <= k < Mb*R; there are Mb*R + S - 1 iterations, so the bubble (idle
fraction of each stage) is (S-1) / (Mb*R + S-1).

Data movement, inside `jax.shard_map` manual over `stage` only (`data` / `model` stay
explicit, so the blocks run their usual typed layouts): after each iteration every stage
hands its output, with the micro-batch's segment ids and positions, to the next with one
`ppermute` (a collective-permute over `stage`; the last stage's goes round to stage 0).
Stage 0 keeps a buffer of Mb micro-batches: it starts as the embedded inputs, and each
result arriving from the last stage is written back into it, where repeat r+1 of that
micro-batch reads it Mb - S + 1 >= 1 iterations later (hence Mb >= S). After the last
iteration stage 0's buffer holds the outputs.

So under GPipe `stage` carries only collective-permutes of activations (and their
transposes), besides what data parallelism over `stage` needs anyway: the all-reduce of the
gradients of the weights replicated over it (embeddings, final norm, LM head) and of the
loss's sums. The circular schedule adds the weights' reorder, once per step: a split of L
over `stage` is contiguous (stage s stores chunks s*R .. s*R + R-1, the checkpoint's layer
order), while the schedule runs chunk c on stage c mod S. `_schedule_chunks` moves each
chunk a stage lacks straight from its holder, one chunk per device per round of
`reorder_rounds` (collective-permutes; at most R rounds, 1 for S = R = 2), in the compute
dtype; the gradients go back the same way. No layout under these constraints avoids it:
MaxText stores circular weights as `[R, S, L/(S*R), ...]` (a different global shape, so not
fsdp's checkpoint), and storing them in schedule order would need a permutation at every
place weights enter or leave (init, Hugging Face import and export, checkpoint save and
restore of the parameters and both Adam moments, LoRA adapters).

As in MaxText's circular pipeline (layers/pipeline.py), every stage runs every iteration
(SPMD): bubble iterations compute on stale values whose results are never stored.
Memory is GPipe's: the backward pass keeps every iteration's activations (per layer, what
the model's remat policy saves), since `jax.grad` transposes this forward loop into a backward
loop that starts after the last forward iteration. `pipeline_schedule=1f1b` keeps 2S-1
micro-batches' instead: one loop does a forward and a backward per iteration, with the final
norm, LM head and loss inside it (zoo/layers/pipeline_1f1b.py, which reuses this module's
pieces); under that schedule this loop still runs the forward alone (evaluation, logits).

jax 0.10.2 gives the shard_map's operands and results, at its boundary, the shardings of
`in_specs` / `out_specs` alone (`stage`), closed on the explicit axes: replicated over
`data` and `model` (jax 0.12 takes them from the arrays' types). XLA drops the resulting
gather where the next use slices the same dims back, as under fsdp_pp; under fsdp_tp_pp it
does not, and the stage's weights and the backward's residuals (every iteration's layer
inputs) cross the boundary gathered: for llama3.1-8b on h100:2x8 the residual stack
`[9, 16, 4, 2048, 1024]` (2.25 GiB) becomes 18 GiB, temporaries 34.7 GiB against 6.6 GiB
under jax 0.12 (README, "Pipeline parallelism").
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from nnx_zoo.errors import UsageError
from shardings.specs import axes_of, normalize
from zoo.layers.pipeline_schedules import resolve_schedule
from zoo.layers.stage import Rows, Stack

# The name a layer's weight slice carries, so that the remat around a layer recomputes it (a
# dynamic slice of weights already resident) instead of keeping one slice per iteration for
# the backward pass (what remat 'none' would otherwise keep).
_STAGE_WEIGHTS = "pipeline_stage_weights"


class PipelinePlan(NamedTuple):
    stages: int  # S, the size of the `stage` mesh axis
    microbatches: int  # Mb
    repeats: int  # R (1: GPipe or 1F1B, > 1: circular)
    layers_per_chunk: int  # Lc = L / (S*R)
    schedule: str = "gpipe"  # gpipe | circular | 1f1b (never "auto": `plan` resolves it)

    @property
    def iterations(self) -> int:
        """The schedule's length in units of one stage's work on one micro-batch (its
        forward, and later or interleaved, its backward): Mb*R + S-1. 1F1B's loop runs
        Mb + 2(S-1) iterations (`loop_iterations`), but its first S-1 do forwards only and
        its last S-1 backwards only, so it takes as long as GPipe's."""
        return self.microbatches * self.repeats + self.stages - 1

    @property
    def loop_iterations(self) -> int:
        """Iterations of the loop that runs the schedule (GPipe and circular: of the forward
        loop; the backward runs as many)."""
        if self.schedule == "1f1b":
            return self.microbatches + 2 * (self.stages - 1)
        return self.iterations

    @property
    def bubble(self) -> float:
        """The idle fraction of each stage's time: (S-1) / (Mb*R + S-1), 1F1B's as GPipe's."""
        return (self.stages - 1) / self.iterations

    @property
    def head_factor(self) -> int:
        """How many times its share of the rows' LM head and loss a device runs: 1 under
        GPipe and circular (after the loop, each stage on its own rows); S under 1F1B (the
        last stage runs every micro-batch's inside the loop, and every other stage the same
        code in SPMD, its result unused)."""
        return self.stages if self.schedule == "1f1b" else 1

    @property
    def in_flight(self) -> int:
        """Micro-batches whose saved activations (what the remat policy keeps, per layer of
        the stage) a device holds at the peak. GPipe and circular: every iteration's,
        Mb*R + S-1, since the backward starts after the whole forward. 1F1B: 2S - 1 on
        stage 0 (S - s on stage s in an asynchronous runtime; in this lock-step loop every
        hand-on takes an iteration, each way, so stage s holds 2(S-1-s) + 1, and every
        stage allocates stage 0's)."""
        if self.schedule == "1f1b":
            return 2 * self.stages - 1
        return self.iterations


def plan(
    num_layers: int, stages: int, microbatches: int, repeats: int, schedule: str = "auto"
) -> PipelinePlan:
    """The schedule for these sizes (`microbatches` 0: one per stage), or UsageError with
    one line saying what would be valid."""
    mb = microbatches or stages
    if repeats < 1:
        raise UsageError(f"pipeline_repeats={repeats}; valid: 1 (GPipe) or more (circular)")
    schedule = resolve_schedule(schedule, repeats)
    if num_layers % (stages * repeats):
        raise UsageError(
            f"num_layers={num_layers} does not divide by stages x repeats = {stages} x "
            f"{repeats}; choose a stage count and pipeline_repeats whose product divides "
            f"{num_layers}"
        )
    if mb < stages:
        raise UsageError(
            f"pipeline_microbatches={mb} is fewer than the {stages} pipeline stages; use at "
            f"least {stages} (or 0: one per stage)"
        )
    if mb % stages:
        # The outputs leave the pipeline split over `stage` by whole micro-batches.
        raise UsageError(
            f"pipeline_microbatches={mb} is not a multiple of the {stages} pipeline stages; "
            f"use {stages * (mb // stages)} or {stages * (mb // stages + 1)} (or 0: one per "
            "stage)"
        )
    return PipelinePlan(stages, mb, repeats, num_layers // (stages * repeats), schedule)


def check_batch(batch_size: int, pp: PipelinePlan, data_shards: int) -> None:
    """Each micro-batch's rows divide over the batch split, else one line."""
    if batch_size % (pp.microbatches * data_shards):
        raise UsageError(
            f"batch size {batch_size} does not cut into {pp.microbatches} pipeline "
            f"micro-batches of rows that divide over the {data_shards}-way batch split; use a "
            f"batch size that is a multiple of {pp.microbatches * data_shards}"
        )


def plan_for(cfg, sharding, mesh) -> PipelinePlan | None:
    """The schedule `cfg` runs on `mesh` under a strategy's `sharding` (an LmSharding), or
    None when the strategy has no stage axis. UsageError (one line) for sizes it cannot run."""
    axis = sharding.stage_axis
    if axis is None:
        return None
    if not cfg.scan_layers:
        raise UsageError("a pipeline strategy splits the stacked layers: set scan_layers=True")
    if cfg.is_moe and cfg.pipeline_schedule == "1f1b" and cfg.router_aux_loss_coef:
        # 1F1B computes its gradients inside the loop from the loss alone: a loss term
        # made of the layers' statistics would get none.
        raise UsageError(
            f"pipeline_schedule=1f1b does not differentiate the router's auxiliary loss "
            f"(router_aux_loss_coef={cfg.router_aux_loss_coef}); set router_aux_loss_coef=0 "
            "or use pipeline_schedule=gpipe / circular"
        )
    return plan(
        cfg.stacked_layers,
        mesh.shape[axis],
        cfg.pipeline_microbatches,
        cfg.pipeline_repeats,
        cfg.pipeline_schedule,
    )


def check_batch_size(batch_size: int, pp: PipelinePlan | None, sharding, mesh) -> None:
    """Rows per forward pass cut into `pp`'s micro-batches that divide over the batch split
    (no pipeline, `pp` None: nothing to check)."""
    if pp is not None:
        check_batch(batch_size, pp, data_shards(sharding.tokens[0], sharding.stage_axis, mesh))


def data_shards(entry, stage_axis, mesh) -> int:
    """The batch split but `stage` (the blocks' batch split)."""
    return math.prod(mesh.shape[a] for a in axes_of(entry) if a != stage_axis)


def chunk_order(num_layers: int, stages: int, repeats: int) -> np.ndarray:
    """The layer indices in the order stage-major storage must hold them for the schedule:
    position (s, r, j) holds layer (r*S + s)*Lc + j. The identity for R = 1."""
    lc = num_layers // (stages * repeats)
    layers = np.arange(num_layers).reshape(repeats, stages, lc)
    return layers.transpose(1, 0, 2).reshape(-1)


class _Reorder(NamedTuple):
    """How the circular schedule's chunks reach their stages from contiguous storage, in
    rounds: in each round every stage sends one of its chunks and receives one (a perfect
    matching of the stage-to-stage moves), so a round is one collective-permute of one chunk
    per device, or nothing when every stage keeps its own."""

    send_slot: np.ndarray  # [rounds, S]: the local slot of the chunk stage h sends
    kept: np.ndarray  # [rounds, S] bool: stage s receives its own chunk (no move)
    pairs: tuple[tuple[tuple[int, int], ...], ...]  # per round, (from, to) of the moves
    round_of: np.ndarray  # [S, R]: the round that brings stage s its repeat-r chunk

    @property
    def moving_rounds(self) -> int:
        """Chunks each device sends (and receives) per pass: R minus the rounds in which
        every stage keeps its own chunk: 0 for GPipe, at most R - 1 when R >= S (stage s
        then holds a chunk it runs), up to R when R < S."""
        return sum(1 for moves in self.pairs if moves)


def reorder_rounds(stages: int, repeats: int) -> _Reorder:
    """The moves that give stage s, from storage where it holds chunks s*R .. s*R + R-1
    (the `layers` rule's contiguous split), chunks r*S + s for r < R (the schedule's).

    Chunk c lives on stage c // R and is wanted by stage c mod S: a bipartite multigraph in
    which every stage sends R chunks and receives R, so it splits into R perfect matchings
    (Koenig). Rounds in which every stage keeps a chunk it holds come first and move nothing;
    their number is the least count of such chunks over the stages, so the moving rounds,
    R minus that, equal the most chunks any one stage must receive: no schedule of whole-chunk
    moves does better."""
    S, R = stages, repeats
    left = set(range(S * R))
    matchings = []
    while True:  # rounds of stages keeping their own
        own = {}
        for c in sorted(left):
            if c // R == c % S and c % S not in own:
                own[c % S] = c
        if len(own) < S:
            break
        matchings.append([own[s] for s in range(S)])
        left -= set(own.values())
    while left:
        to = _perfect_matching(left, S, R)
        matchings.append([to[s] for s in range(S)])
        left -= set(to.values())
    send_slot = np.zeros((R, S), np.int32)
    kept = np.zeros((R, S), bool)
    round_of = np.zeros((S, R), np.int32)
    pairs = []
    for k, chunks in enumerate(matchings):
        for s, c in enumerate(chunks):
            send_slot[k, c // R] = c % R
            kept[k, s] = c // R == s
            round_of[s, c // S] = k
        pairs.append(tuple((c // R, s) for s, c in enumerate(chunks) if c // R != s))
    return _Reorder(send_slot, kept, tuple(pairs), round_of)


def _perfect_matching(chunks: set[int], S: int, R: int) -> dict[int, int]:
    """receiving stage -> chunk: one chunk out of every stage and one into every stage,
    chunk c going from stage c // R to stage c mod S (Kuhn's augmenting paths; the moves
    left form a regular bipartite multigraph, so one exists)."""
    to: dict[int, int] = {}

    def augment(sender: int, seen: set[int]) -> bool:
        for c in sorted(chunks):
            if c // R != sender or c % S in seen:
                continue
            seen.add(c % S)
            if c % S not in to or augment(to[c % S] // R, seen):
                to[c % S] = c
                return True
        return False

    for sender in range(S):
        if not augment(sender, set()):
            raise AssertionError(f"no perfect matching of chunk moves for S={S}, R={R}")
    return to


def _schedule_chunks(w, stage, stage_axis: str, reorder: _Reorder, R: int, Lc: int):
    """This stage's stored layers `[R*Lc, ...]` (chunks s*R .. s*R + R-1, the checkpoint's
    order) -> `[R, Lc, ...]`, repeat r holding chunk r*S + s: the schedule's. Inside the
    shard_map, `stage` being this stage's index. R = 1: a reshape. R > 1: one
    collective-permute of one chunk per device for each of `reorder`'s moving rounds (and
    their transposes for the gradients), since a split of L over `stage` can only be
    contiguous while the circular schedule runs chunk c on stage c mod S."""
    w_R = w.reshape(R, Lc, *w.shape[1:])
    if R == 1:
        return w_R
    send_slot, kept = jnp.asarray(reorder.send_slot), jnp.asarray(reorder.kept)
    round_of = jnp.asarray(reorder.round_of)
    arrived = []
    for k, moves in enumerate(reorder.pairs):
        chunk = jax.lax.dynamic_index_in_dim(w_R, send_slot[k, stage], 0, keepdims=False)
        if moves:
            moved = jax.lax.ppermute(chunk, stage_axis, moves)
            chunk = jnp.where(kept[k, stage], chunk, moved)
        arrived.append(chunk)
    arrived = jnp.stack(arrived)
    return jnp.stack(
        [jax.lax.dynamic_index_in_dim(arrived, round_of[stage, r], 0, False) for r in range(R)]
    )


def microbatch(a, mb: int, stage_axis: str):
    """[B, ...] with B split over (batch axes, stage) -> [Mb, B/Mb, ...] with Mb over
    `stage` and B/Mb over the batch axes, with no communication: each device's B/(D*S) rows
    are Mb/S micro-batches' shares, micro-batch s*Mb/S + j being stage s's j-th slice of
    its rows in every data shard."""
    mesh = jax.typeof(a).sharding.mesh
    spec = normalize(jax.typeof(a).sharding.spec, a.ndim)
    data = tuple(x for x in axes_of(spec[0]) if x != stage_axis)
    data_entry = data[0] if len(data) == 1 else (data or None)
    D, S = math.prod(mesh.shape[x] for x in data), mesh.shape[stage_axis]
    B, rest, rest_spec = a.shape[0], a.shape[1:], tuple(spec)[1:]
    b = B // (D * mb)
    a = a.reshape(
        D, S, mb // S, b, *rest, out_sharding=P(data_entry, stage_axis, *(None,) * 2, *rest_spec)
    )
    a = jnp.moveaxis(a, 0, 2)  # [S, Mb/S, D, b, ...]
    return a.reshape(mb, D * b, *rest, out_sharding=P(stage_axis, data_entry, *rest_spec))


def unmicrobatch(a, stage_axis: str):
    """The inverse of `microbatch`: [Mb, B/Mb, ...] -> [B, ...] split over (batch axes,
    stage)."""
    mesh = jax.typeof(a).sharding.mesh
    spec = normalize(jax.typeof(a).sharding.spec, a.ndim)
    data_entry, rest_spec = spec[1], tuple(spec)[2:]
    data = axes_of(data_entry)
    D, S = math.prod(mesh.shape[x] for x in data), mesh.shape[stage_axis]
    mb, rest = a.shape[0], a.shape[2:]
    b = a.shape[1] // D
    a = a.reshape(
        S, mb // S, D, b, *rest, out_sharding=P(stage_axis, None, data_entry, None, *rest_spec)
    )
    a = jnp.moveaxis(a, 2, 0)  # [D, S, Mb/S, b, ...]
    rows = (*data, stage_axis)
    return a.reshape(
        D * mb * b, *rest, out_sharding=P(rows if len(rows) > 1 else rows[0], *rest_spec)
    )


def stage_tables(consts, pp: PipelinePlan, stage_axis: str):
    """A `Stack`'s per-layer constants `[L, ...]` in schedule order, `[S, R, Lc, ...]` laid
    out over `stage` (stage s, repeat r reads row (s, r))."""
    S, R, Lc = pp.stages, pp.repeats, pp.layers_per_chunk
    order = chunk_order(S * R * Lc, S, R)

    def table(c):
        c = np.asarray(c)
        # Laid out over `stage` before the shard_map: jax >= 0.12 refuses an input whose
        # layout differs from its in_spec rather than resharding it.
        return jax.sharding.reshard(jnp.asarray(c[order].reshape(S, R, Lc, *c.shape[1:])), split)

    split = P(stage_axis)
    return jax.tree.map(table, consts)


def layer_policy(stack: Stack):
    """The remat policy each layer of a stage runs under: the model's, or for "save
    everything" (None) everything but the layer's weight slice (`_STAGE_WEIGHTS`)."""
    if stack.policy is not None:
        return stack.policy
    return jax.checkpoint_policies.save_anything_except_these_names(_STAGE_WEIGHTS)


def _named(tree):
    return jax.tree.map(lambda a: checkpoint_name(a, _STAGE_WEIGHTS), tree)


def layer_weights(stack: Stack, weights_RL, r, j, valid):
    """Layer (r, j)'s weights as the layer computes with them: sliced from the stage's
    (loop-invariant) stack, zero in a bubble iteration (`valid` False), cast by the model.
    Each step is named, so the remat around the layer recomputes it (a slice of weights
    already resident) instead of keeping one per iteration. The zero makes a bubble's share
    of the weight gradient a select, so a bubble's non-finite values never reach it."""

    def take(w):
        w = checkpoint_name(w[r, j], _STAGE_WEIGHTS)
        return checkpoint_name(jnp.where(valid, w, jnp.zeros_like(w)), _STAGE_WEIGHTS)

    return _named(stack.cast(jax.tree.map(take, weights_RL)))


def run_layers(stack: Stack, policy, weights_RL, consts_RL, x, rows: Rows, r, valid):
    """Repeat r's Lc layers of this stage on one micro-batch, inside the pipeline's
    shard_map: (x, the layers' statistics `[Lc, ...]`, zero in a bubble; None without).
    A bubble iteration (`valid` False) runs on zeros.

    Each layer's weights are sliced from the stage's stack inside the layer's own checkpoint,
    under the model's remat policy, which never saves them: so the backward pass re-slices
    them rather than keeping a copy of the stage's weights per iteration (9 copies, 7 GiB a
    device, for 8B on 2 stages with Mb = 8)."""

    @functools.partial(jax.checkpoint, policy=policy)
    def layer(weights_RL, x, j):
        w = layer_weights(stack, weights_RL, r, j, valid)
        return stack.layer(w, x, rows, jax.tree.map(lambda c: c[r, j], consts_RL))

    def one(x, j):
        if stack.stats is None:
            return layer(weights_RL, x, j), None
        x, stats = layer(weights_RL, x, j)
        return x, pick(valid, stats, jax.tree.map(jnp.zeros_like, stats))

    x = jnp.where(valid, x, jnp.zeros_like(x))
    Lc = jax.tree.leaves(weights_RL)[0].shape[1]
    return jax.lax.scan(one, x, jnp.arange(Lc))


def stats_buffer(stack: Stack, repeats: int, layers_per_chunk: int, stage_axis: str):
    """Zero sums of each of a stage's layers' statistics, `[R, Lc, ...]` (None without)."""
    if stack.stats is None:
        return None
    zeros = jax.tree.map(
        lambda z: jnp.zeros((repeats, layers_per_chunk, *jnp.shape(z)), jnp.float32), stack.stats
    )
    return varying(zeros, stage_axis)


def layer_order_stats(stats, pp: PipelinePlan):
    """The shard_map's statistics out, `[S*R, Lc, ...]` in schedule order (stage s, repeat
    r, layer j), -> `[L, ...]` in layer order (None stays None). A few floats per layer:
    gathered whole first."""
    if stats is None:
        return None
    L = pp.stages * pp.repeats * pp.layers_per_chunk
    position_of = np.argsort(chunk_order(L, pp.stages, pp.repeats))

    def reorder(a):
        a = jax.sharding.reshard(a, P())
        return a.reshape(L, *a.shape[2:])[position_of]

    return jax.tree.map(reorder, stats)


def to_stage_0(a, stage_axis: str, S: int):
    """Inside the shard_map: every stage k sends stage 0 its micro-batches (S-1
    collective-permutes); stage 0's result holds all of them in order (only its is read)."""
    sent = [jax.lax.ppermute(a, stage_axis, [(k, 0)]) for k in range(1, S)]
    return jnp.concatenate([a, *sent], axis=0)


def from_stage_0(buf, s, stage_axis: str, S: int):
    """The inverse of `to_stage_0`: stage 0 keeps its own n = Mb/S micro-batches of `buf`
    and sends stage k the k-th n (S-1 collective-permutes), so each stage gets back the
    rows it brought in."""
    n = buf.shape[0] // S
    out = buf[:n]
    for k in range(1, S):
        received = jax.lax.ppermute(buf[k * n : (k + 1) * n], stage_axis, [(0, k)])
        out = jnp.where(s == k, received, out)
    return out


def varying(tree, axis: str):
    """`tree`, made of constants (the same on every stage), typed as varying over `axis`: a
    scan carry's start must type as its body's result does under the varying-axes check
    (without the check, unchanged)."""
    return jax.lax.pcast(tree, axis, to="varying")


def at(buf, i):
    """Entry i of every array of `buf` (a pytree of `[n, ...]` arrays)."""
    return jax.tree.map(lambda b: jax.lax.dynamic_index_in_dim(b, i, 0, keepdims=False), buf)


def pick(pred, a, b):
    """`a` where `pred`, else `b`, leaf by leaf (pytrees of one structure)."""
    return jax.tree.map(lambda x, y: jnp.where(pred, x, y), a, b)


class Hop(NamedTuple):
    """What one stage hands the next after an iteration: a micro-batch's activations and the
    rows that travel with them."""

    x: jax.Array
    rows: Rows


class _Carry(NamedTuple):
    """The forward loop's carry."""

    outputs: jax.Array  # stage 0's Mb micro-batches: the inputs, then each one's result
    arrived: Hop  # what the previous stage sent at the last iteration
    stats: object  # this stage's layers' statistics summed so far, `[R, Lc, ...]`, or None


def schedule_weights(stack: Stack, weights, s, stage_axis: str, pp: PipelinePlan):
    """This stage's stored weights `[R*Lc, ...]` (the checkpoint's order) -> `[R, Lc, ...]`
    in the schedule's, in their own dtype. The circular schedule's chunk moves carry the
    model's compute dtype (`stack.cast`), and their values come back exact in the weights'
    dtype, so the gradient sums of the loop stay in the weights' dtype."""
    R, Lc = pp.repeats, pp.layers_per_chunk
    if R == 1:
        return jax.tree.map(lambda w: w.reshape(1, Lc, *w.shape[1:]), weights)
    reorder = reorder_rounds(pp.stages, R)
    moving = jax.vmap(stack.cast)(weights)
    moved = jax.tree.map(lambda w: _schedule_chunks(w, s, stage_axis, reorder, R, Lc), moving)
    return jax.tree.map(lambda m, w: m.astype(w.dtype), moved, weights)


def _iteration_fn(stack, pp, stage_axis, s, weights_RL, consts_RL, feed: Hop):
    """One iteration t of the forward loop on stage s: item k = t - s (micro-batch k mod Mb,
    repeat k // Mb) when 0 <= k < Mb*R, else a bubble; the result goes on to the next stage,
    and stage 0 files what the last stage sent under its micro-batch."""
    S, Mb, R = pp.stages, pp.microbatches, pp.repeats
    ring = [(i, (i + 1) % S) for i in range(S)]
    policy = layer_policy(stack)

    def iteration(carry: _Carry, t):
        k = t - s
        m, r = k % Mb, jnp.clip(k // Mb, 0, R - 1)
        valid = (k >= 0) & (k < Mb * R)
        # Stage 0 reads its buffer (the inputs, or repeat r-1's result); the others what
        # arrived.
        mine = pick(s == 0, Hop(at(carry.outputs, m), at(feed.rows, m)), carry.arrived)
        y, stats_L = run_layers(stack, policy, weights_RL, consts_RL, mine.x, mine.rows, r, valid)
        stats = carry.stats
        if stats is not None:
            stats = jax.tree.map(
                lambda acc, v: jax.lax.dynamic_update_index_in_dim(acc, at(acc, r) + v, r, 0),
                stats,
                stats_L,
            )
        arrived = jax.lax.ppermute(Hop(y, mine.rows), stage_axis, ring)
        # Stage 0 receives the last stage's result of item t - (S-1).
        k_last = t - (S - 1)
        done = (s == 0) & (k_last >= 0) & (k_last < Mb * R)
        slot = k_last % Mb
        kept = jnp.where(done, arrived.x, at(carry.outputs, slot))
        outputs = jax.lax.dynamic_update_index_in_dim(carry.outputs, kept, slot, 0)
        return _Carry(outputs, arrived, stats), None

    return iteration


def run_stack(stack: Stack, pp: PipelinePlan, stage_axis: str, x_BTM, rows: Rows):
    """The forward pipeline (GPipe / circular) `pp` over `stage_axis` of `stack` on `x_BTM`
    and its `rows` (rows split over (batch axes, stage), as the strategy's `batch` rule says
    for everything outside the layer stack): (the same rows out, the layers' statistics
    summed over the micro-batches `[L, ...]` or None). Under `pipeline_schedule=1f1b` this
    is the forward alone (evaluation, logits)."""
    mesh = jax.sharding.get_abstract_mesh()
    S, Mb = pp.stages, pp.microbatches
    check_batch(
        x_BTM.shape[0], pp, data_shards(jax.typeof(x_BTM).sharding.spec[0], stage_axis, mesh)
    )
    # [Mb, B/Mb, ...], Mb over `stage`: stage s holds micro-batches s*n .. (s+1)*n - 1.
    inputs = Hop(
        microbatch(x_BTM, Mb, stage_axis),
        jax.tree.map(lambda a: microbatch(a, Mb, stage_axis), rows),
    )
    tables = stage_tables(stack.consts, pp, stage_axis)

    def local(weights, inputs: Hop, tables):
        s = jax.lax.axis_index(stage_axis)
        weights_RL = schedule_weights(stack, weights, s, stage_axis, pp)
        consts_RL = jax.tree.map(lambda c: c[0], tables)  # [1, R, Lc, ...] -> [R, Lc, ...]
        # Stage 0 feeds the pipeline; only its buffers are read.
        feed = jax.tree.map(lambda a: to_stage_0(a, stage_axis, S), inputs)
        iteration = _iteration_fn(stack, pp, stage_axis, s, weights_RL, consts_RL, feed)
        # zeros_like keeps the varying type of what it copies.
        stats = stats_buffer(stack, pp.repeats, pp.layers_per_chunk, stage_axis)
        start = _Carry(feed.x, jax.tree.map(jnp.zeros_like, at(feed, 0)), stats)
        carry, _ = jax.lax.scan(iteration, start, jnp.arange(pp.iterations))
        # Stage 0 holds the outputs; each stage gets back the rows it brought in.
        return from_stage_0(carry.outputs, s, stage_axis, S), carry.stats

    split = P(stage_axis)
    out, stats = jax.shard_map(
        local,
        in_specs=(split, split, split),
        out_specs=(split, split),
        axis_names={stage_axis},
        check_vma=stack.check_vma,
    )(stack.weights, inputs, tables)
    return unmicrobatch(out, stage_axis), layer_order_stats(stats, pp)
