"""The 1F1B pipeline schedule: one forward and one backward per iteration, the loss inside.

Under GPipe and the circular schedule (zoo/layers/pipeline.py) `jax.grad` transposes the
forward loop into a backward loop that starts after the last forward iteration, so every
micro-batch's saved activations (what the remat policy keeps, per layer of the stage) are
live at once: `Mb*R + S-1` of them. 1F1B starts micro-batch m's backward as soon as its
forward leaves the last stage, which needs two things this module provides:

1. The final norm, the LM head and the loss inside the loop: the last stage runs them on
   each micro-batch it finishes, with the labels and loss mask that travel with the
   activations, and seeds that micro-batch's backward with their gradient at once.
2. The gradient inside the forward: `nll_sum` is a `jax.custom_vjp` whose forward rule runs
   one loop doing both passes and returns the summed loss with the gradients of every input
   (stage weights, the `LossHead`'s parameters, the embedded rows), accumulated in the loop's
   carry;
   the backward rule only scales them by the incoming cotangent (the loss is a sum, so
   that cotangent is a scalar: 1, or gradient accumulation's). Without differentiation
   (evaluation) the primal runs the GPipe forward.

The loop (inside `jax.shard_map` manual over `stage` only, as GPipe's), iteration t, stage s:
forward of micro-batch t - s, backward of micro-batch t - (2S-2-s). The last stage runs both
on the same micro-batch in one iteration (forward, head and loss, backward); every hand-on
(activations forward, cotangents back) is one collective-permute and takes one iteration.
Its Mb + 2(S-1) iterations run in three loops: S-1 forwards only (the warm-up), Mb both
(forward, head and loss, backward), S-1 backwards only (the cool-down). A stage's time is
then (S-1)F + Mb(F+B) + (S-1)B = (Mb+S-1)(F+B), GPipe's, so the bubble is GPipe's
(S-1)/(Mb+S-1); as in GPipe, every stage runs every iteration's work (SPMD) and bubble
iterations compute on values no result reads.

Residuals. The forward of micro-batch m runs each of the stage's layers as `jax.vjp` (under
the remat policy, as GPipe's layers run under it); the leaves of the layers' pullbacks (the
residuals: what the policy saves per layer, e.g. under `full` each layer's input, Lc x
`[b, T, M]`) are written into slot m mod K of fixed-shape ring buffers in the carry,
K = 2S-1, and read back by m's backward 2(S-1-s) iterations later; stage 0 holds the most in
flight (2S-1; an asynchronous runtime holds S - s, but here each hand-on costs an iteration
each way). A layer's weight slice, a residual of its pullback, is not copied into the ring:
the backward slices it again from the loop-invariant stack, so no slot holds weights. Which
pullback leaves are the weight slice is read once, before the loops, from the jaxpr of one
layer's forward (`residual_layout`: an output that is an input variable is that input), not
from Python object identity. The backward walks the layers in reverse and adds each layer's
weight gradient into its slice of the loop's sums in place, so no stage-sized gradient
exists per micro-batch.

Costs against GPipe, both stated in docs/pipeline-1f1b.md: the LM head and loss run on the
last stage for every micro-batch (GPipe runs them after the loop on each stage's own rows,
1/S of them), and every stage runs that code in SPMD (its result is used on the last stage
only), so a step's critical path gains (Mb - Mb/S) micro-batches' head forward and backward.
The weight gradients accumulate over micro-batches in the parameters' dtype (float32), as
under GPipe: each layer casts its slice to the compute dtype inside the layer
(`Stack.cast`), so the loop differentiates with respect to the parameters themselves.

Bubble iterations compute on values no result reads, which may be non-finite (a layer on
zeros, a stale micro-batch): every gradient they produce is dropped by a select before it is
added or sent, so none reaches the sums (a product with a zero cotangent would not: 0 x inf
is NaN).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from shardings.specs import normalize
from zoo.layers import pipeline
from zoo.layers.pipeline import Hop, PipelinePlan, at, pick, varying
from zoo.layers.stage import LossHead, Rows, Stack


def nll_sum(stack: Stack, head: LossHead, pp: PipelinePlan, stage_axis: str, x_BTM, rows: Rows):
    """(`head.loss` summed over every micro-batch of `stack`'s output on the embedded rows
    `x_BTM` (split over (batch axes, stage)), whose gradient the 1F1B loop computes as it
    runs; the layers' statistics summed over the micro-batches `[L, ...]`, or None). `rows`
    carries the ids, positions, targets and mask of `x_BTM`'s rows. The statistics are
    outputs, not losses: no gradient flows from them (the loop's gradients are the loss's
    alone; `pipeline.plan_for` refuses a loss term made of them)."""
    w_leaves, w_def = jax.tree.flatten(stack.weights)
    h_leaves, h_def = jax.tree.flatten(head.params)

    def with_leaves(w_leaves, h_leaves):
        return (
            stack._replace(weights=jax.tree.unflatten(w_def, w_leaves)),
            head._replace(params=jax.tree.unflatten(h_def, h_leaves)),
        )

    @jax.custom_vjp
    def summed(w_leaves, h_leaves, x_BTM, rows):
        # Not differentiated (evaluation): the GPipe forward, then the loss on each stage's
        # own rows.
        stack, head = with_leaves(w_leaves, h_leaves)
        rows_in = Rows(rows.ids, rows.positions)
        y, stats = pipeline.run_stack(stack, pp, stage_axis, x_BTM, rows_in)
        return _loss_on_own_rows(head, pp, stage_axis, y, rows), stats

    def summed_fwd(w_leaves, h_leaves, x_BTM, rows):
        stack, head = with_leaves(w_leaves, h_leaves)
        total, grads, stats = _run(stack, head, pp, stage_axis, x_BTM, rows)
        return (total, stats), grads

    def summed_bwd(grads, cotangents):
        # The loss is a sum: its cotangent g scales every gradient the loop computed. The
        # statistics' cotangent is dropped (see above).
        g, _ = cotangents
        d_w, d_h, d_x = jax.tree.map(lambda d: (d * g).astype(d.dtype), grads)
        return d_w, d_h, d_x, None

    summed.defvjp(summed_fwd, summed_bwd)
    return summed(w_leaves, h_leaves, x_BTM, rows)


def _loss_on_own_rows(head: LossHead, pp: PipelinePlan, stage_axis: str, y_BTM, rows: Rows):
    """`head.loss` of every micro-batch, each stage on its own (no communication but the
    sum's all-reduce)."""

    def local(params, y, rows):
        def add(total, m):
            return total + head.loss(params, y[m], at(rows, m)), None

        total, _ = jax.lax.scan(
            add, varying(jnp.zeros((), jnp.float32), stage_axis), jnp.arange(y.shape[0])
        )
        return jax.lax.psum(total, stage_axis)

    mb = lambda a: pipeline.microbatch(a, pp.microbatches, stage_axis)  # noqa: E731
    split = P(stage_axis)
    return jax.shard_map(
        local, in_specs=(P(), split, split), out_specs=P(), axis_names={stage_axis}
    )(head.params, mb(y_BTM), jax.tree.map(mb, rows))


# -- residuals ---------------------------------------------------------------------------


class Residuals(NamedTuple):
    """Which leaves of one layer's pullback a micro-batch's forward keeps for its backward:
    all but the layer's weight slice, which the backward slices again from the stack."""

    treedef: Any  # the pullback's
    weight_of: tuple[int | None, ...]  # per pullback leaf: the weight leaf it is, or None

    def keep(self, pullback) -> list:
        leaves = jax.tree.leaves(pullback)
        if len(leaves) != len(self.weight_of):
            raise AssertionError("1F1B: a layer's pullback differs from its layout")
        return [a for a, w in zip(leaves, self.weight_of, strict=True) if w is None]

    def join(self, kept, w_leaves):
        it = iter(kept)
        leaves = [next(it) if w is None else w_leaves[w] for w in self.weight_of]
        return jax.tree.unflatten(self.treedef, leaves)


def residual_layout(layer_vjp, w, x) -> Residuals:
    """The `Residuals` of `layer_vjp(w, x) -> (y, pullback)`, read from the jaxpr of its
    pullback's leaves: a leaf that is one of `w`'s input variables is that weight."""
    closed, shapes = jax.make_jaxpr(lambda w, x: layer_vjp(w, x)[1], return_shape=True)(w, x)
    invars = closed.jaxpr.invars[: len(jax.tree.leaves(w))]
    weight_of = tuple(invars.index(v) if v in invars else None for v in closed.jaxpr.outvars)
    return Residuals(jax.tree.structure(shapes), weight_of)


# -- one stage ---------------------------------------------------------------------------


class _Stage(NamedTuple):
    """What every iteration on this stage reads (loop invariants)."""

    stack: Stack
    head: LossHead
    pp: PipelinePlan
    stage_axis: str
    s: jax.Array  # this stage's index
    w_leaves: list  # the stage's stacked weights `[Lc, ...]`, the parameters' dtype
    w_def: Any
    consts_L: Any  # the stage's per-layer constants `[Lc, ...]`
    feed: Hop  # stage 0's micro-batches (rows with targets and mask)
    residuals: Residuals | None

    def layer_vjp(self, j, rows: Rows):
        """`(w, x) -> (y, pullback)`: layer j of the stage as `jax.vjp` under the remat
        policy, differentiated with respect to its weight slice (the parameters' dtype; the
        cast to the compute dtype is inside, recomputed, never kept) and its input."""
        stack = self.stack
        consts_j = jax.tree.map(lambda c: c[j], self.consts_L)

        @functools.partial(jax.checkpoint, policy=pipeline.layer_policy(stack))
        def layer(w, x):
            return stack.layer(pipeline._named(stack.cast(w)), x, rows, consts_j)

        def vjp(w, x):
            # With statistics: (y, pullback, the layer's statistics).
            w = jax.tree.unflatten(self.w_def, w)
            return jax.vjp(layer, w, x, has_aux=stack.stats is not None)

        return vjp

    def weights(self, j) -> list:
        """Layer j's weight slice, from the stage's loop-invariant stack."""
        return [jax.lax.dynamic_index_in_dim(w, j, 0, False) for w in self.w_leaves]


def _stage_forward(st: _Stage, x, rows: Rows):
    """(y, (the residuals kept per layer, the layers' statistics or None), each stacked over
    the stage's layers)."""

    def one(x, j):
        y, pullback, *stats = st.layer_vjp(j, rows)(st.weights(j), x)
        return y, (st.residuals.keep(pullback), stats[0] if stats else None)

    return jax.lax.scan(one, x, jnp.arange(len(jax.tree.leaves(st.consts_L)[0])))


def _stage_backward(st: _Stage, cot, kept, d_weights, valid):
    """The stage's backward from its output's cotangent: layer by layer in reverse, each
    layer's weight gradient added into its slice of `d_weights` (the loop's sums, updated in
    place) unless the micro-batch is a bubble's; the input's cotangent out (zero for a
    bubble)."""

    def one(carry, xs):
        d_x, d_weights = carry
        kept_j, j = xs
        w = st.weights(j)
        d_w, d_x = st.residuals.join(kept_j, w)(d_x)
        d_weights = [
            jax.lax.dynamic_update_index_in_dim(
                acc, at(acc, j) + jnp.where(valid, d, jnp.zeros_like(d)).astype(acc.dtype), j, 0
            )
            for acc, d in zip(d_weights, jax.tree.leaves(d_w), strict=True)
        ]
        return (d_x, d_weights), None

    Lc = st.w_leaves[0].shape[0]
    (d_x, d_weights), _ = jax.lax.scan(one, (cot, d_weights), (kept, jnp.arange(Lc)), reverse=True)
    return jnp.where(valid, d_x, jnp.zeros_like(d_x)), d_weights


# -- the loop's carries and its three kinds of iteration ---------------------------------


class _Forward(NamedTuple):
    """The forward half's carry."""

    arrived: Hop  # what the previous stage sent
    ring: tuple  # per kept residual, `[K, Lc, ...]`: slot m mod K holds micro-batch m's
    stats: Any  # the stage's layers' statistics summed so far, `[Lc, ...]`, or None


class _Sums(NamedTuple):
    """The backward half's carry: what arrived and what accumulates."""

    cot: jax.Array  # the cotangent the next stage sent
    d_weights: list  # the stage's weight gradient, the parameters' dtype
    d_head: list  # the LossHead parameters' gradient
    loss: jax.Array  # float32
    d_inputs: jax.Array  # stage 0: the embedded rows' gradient, `[Mb, ...]`


def _forward_half(st: _Stage, carry: _Forward, t):
    """Forward of micro-batch t - s: its residuals into the ring, its output (and its rows)
    on to the next stage. Returns the carry and what this stage computed."""
    S, Mb, K = st.pp.stages, st.pp.microbatches, st.pp.in_flight
    m = t - st.s
    mine = pick(st.s == 0, at(st.feed, m % Mb), carry.arrived)
    y, (kept, stats_L) = _stage_forward(st, mine.x, mine.rows)
    stats = carry.stats
    if stats is not None:
        valid = (m >= 0) & (m < Mb)
        stats = jax.tree.map(lambda acc, v: acc + jnp.where(valid, v, 0.0), stats, stats_L)
    # Slot m mod K: any slot written while m is in flight belongs to a micro-batch at most
    # 2S-2 apart, so none is live (bubble iterations included, whose m < 0 or m >= Mb).
    ring = tuple(
        jax.lax.dynamic_update_index_in_dim(r, v, m % K, 0)
        for r, v in zip(carry.ring, kept, strict=True)
    )
    forward_ring = [(i, (i + 1) % S) for i in range(S)]
    arrived = jax.lax.ppermute(Hop(y, mine.rows), st.stage_axis, forward_ring)
    return _Forward(arrived, ring, stats), Hop(y, mine.rows)


def _head_half(st: _Stage, sums: _Sums, done: Hop):
    """The last stage finishes micro-batch t - (S-1): the loss and its gradients (of the
    head's parameters, and the seed of the micro-batch's backward). Every other stage runs
    the same on its own output (SPMD); selects keep only the last stage's."""
    last = st.s == st.pp.stages - 1
    # Differentiated as this stage's own copy: the gradient of a value the same on every
    # stage would come out summed over `stage` under the varying-axes check.
    params = varying(st.head.params, st.stage_axis)
    loss_m, pullback = jax.vjp(lambda params, y: st.head.loss(params, y, done.rows), params, done.x)
    d_head, seed = pullback(jnp.ones_like(loss_m))
    d_head = [
        acc + jnp.where(last, d, jnp.zeros_like(d))
        for acc, d in zip(sums.d_head, jax.tree.leaves(d_head), strict=True)
    ]
    loss = sums.loss + jnp.where(last, loss_m, 0.0)
    return sums._replace(d_head=d_head, loss=loss, cot=jnp.where(last, seed, sums.cot))


def _backward_half(st: _Stage, ring: tuple, sums: _Sums, t):
    """Backward of micro-batch t - (2S-2-s) from the cotangent in `sums` (sent by the next
    stage; the last stage's own seed): its weight gradients into the sums, its input's
    cotangent to the previous stage (stage 0: into the rows' gradient)."""
    S, Mb, K = st.pp.stages, st.pp.microbatches, st.pp.in_flight
    m = t - (2 * S - 2 - st.s)
    valid = (m >= 0) & (m < Mb)
    kept = [jax.lax.dynamic_index_in_dim(r, m % K, 0, keepdims=False) for r in ring]
    d_x, d_weights = _stage_backward(st, sums.cot, kept, sums.d_weights, valid)
    slot = m % Mb
    stored = jnp.where(valid & (st.s == 0), d_x, at(sums.d_inputs, slot))
    d_inputs = jax.lax.dynamic_update_index_in_dim(sums.d_inputs, stored, slot, 0)
    backward_ring = [(i, (i - 1) % S) for i in range(S)]
    cot = jax.lax.ppermute(d_x, st.stage_axis, backward_ring)
    return sums._replace(cot=cot, d_weights=d_weights, d_inputs=d_inputs)


def _warmup(st: _Stage, fwd: _Forward, t):
    fwd, _ = _forward_half(st, fwd, t)
    return fwd, None


def _steady(st: _Stage, carry: tuple[_Forward, _Sums], t):
    fwd, sums = carry
    fwd, done = _forward_half(st, fwd, t)
    sums = _backward_half(st, fwd.ring, _head_half(st, sums, done), t)
    return (fwd, sums), None


def _cooldown(st: _Stage, ring: tuple, sums: _Sums, t):
    return _backward_half(st, ring, sums, t), None


# -- the loop ----------------------------------------------------------------------------


def _local(stack, head, pp, stage_axis, w_def, h_def, w_leaves, h_leaves, tables, inputs: Hop):
    """The shard_map body: this stage's share of the loop. (summed loss, weight gradients,
    head gradients, the embedded rows' gradient, the layers' statistics `[1, Lc, ...]` or
    None)."""
    S, Mb, K = pp.stages, pp.microbatches, pp.in_flight
    s = jax.lax.axis_index(stage_axis)
    consts_L = jax.tree.map(lambda c: c[0, 0], tables)  # [1, 1, Lc, ...] -> [Lc, ...]
    # Every array the loop reads enters as an operand (none is closed over).
    stack = stack._replace(weights=None, consts=None)
    head = head._replace(params=jax.tree.unflatten(h_def, h_leaves))
    # Stage 0 feeds the pipeline (only its buffers are read); the rows travel with the
    # activations.
    feed = jax.tree.map(lambda a: pipeline.to_stage_0(a, stage_axis, S), inputs)
    st = _Stage(stack, head, pp, stage_axis, s, w_leaves, w_def, consts_L, feed, None)
    first = at(feed, 0)
    w0 = st.weights(0)
    st = st._replace(residuals=residual_layout(st.layer_vjp(0, first.rows), w0, first.x))
    # Shapes of the ring's slots, from a trace whose results nothing reads (XLA drops it).
    _, (kept0, _) = _stage_forward(st, first.x, first.rows)
    ring = tuple(jnp.zeros((K, *a.shape), a.dtype, out_sharding=_slots(a)) for a in kept0)
    Lc = w_leaves[0].shape[0]
    stats = pipeline.stats_buffer(stack, 1, Lc, stage_axis)

    # Each loop carries only what it uses, so no buffer lives longer than it must. (zeros_like
    # keeps the varying type of what it copies; the rest starts the same on every stage.)
    fwd = _Forward(
        jax.tree.map(jnp.zeros_like, first),
        varying(ring, stage_axis),
        None if stats is None else jax.tree.map(lambda a: a[0], stats),
    )
    fwd, _ = jax.lax.scan(functools.partial(_warmup, st), fwd, jnp.arange(S - 1))
    sums = _Sums(
        cot=jnp.zeros_like(first.x),
        d_weights=[jnp.zeros_like(w) for w in w_leaves],
        d_head=varying([jnp.zeros_like(p) for p in jax.tree.leaves(head.params)], stage_axis),
        loss=varying(jnp.zeros((), jnp.float32), stage_axis),
        d_inputs=jnp.zeros_like(feed.x),
    )
    (fwd, sums), _ = jax.lax.scan(
        functools.partial(_steady, st), (fwd, sums), jnp.arange(S - 1, Mb + S - 1)
    )
    sums, _ = jax.lax.scan(
        functools.partial(_cooldown, st, fwd.ring), sums, jnp.arange(Mb + S - 1, Mb + 2 * S - 2)
    )
    # The loss and the head's gradients counted on the last stage only: summed over `stage`
    # (the all-reduce data parallelism over `stage` needs for them under GPipe too).
    total = jax.lax.psum(sums.loss, stage_axis)
    d_head = [jax.lax.psum(d, stage_axis) for d in sums.d_head]
    d_inputs = pipeline.from_stage_0(sums.d_inputs, s, stage_axis, S)
    stats = None if fwd.stats is None else jax.tree.map(lambda a: a[None], fwd.stats)
    return total, sums.d_weights, d_head, d_inputs, stats


def _run(stack: Stack, head: LossHead, pp: PipelinePlan, stage_axis: str, x_BTM, rows: Rows):
    """The 1F1B loop of one step: (summed loss, (weight leaves' gradients, head parameter
    leaves' gradients, x_BTM's gradient), the layers' statistics `[L, ...]` or None)."""
    mesh = jax.sharding.get_abstract_mesh()
    pipeline.check_batch(
        x_BTM.shape[0],
        pp,
        pipeline.data_shards(jax.typeof(x_BTM).sharding.spec[0], stage_axis, mesh),
    )
    w_leaves, w_def = jax.tree.flatten(stack.weights)
    h_leaves, h_def = jax.tree.flatten(head.params)
    mb = lambda a: pipeline.microbatch(a, pp.microbatches, stage_axis)  # noqa: E731
    # [Mb, B/Mb, ...], Mb over `stage`: stage s holds micro-batches s*n .. (s+1)*n - 1.
    inputs = Hop(mb(x_BTM), jax.tree.map(mb, rows))
    tables = pipeline.stage_tables(stack.consts, pp, stage_axis)
    split = P(stage_axis)
    total, d_w, d_h, d_inputs, stats = jax.shard_map(
        functools.partial(_local, stack, head._replace(params=None), pp, stage_axis, w_def, h_def),
        in_specs=(split, P(), split, split),
        out_specs=(P(), [split] * len(w_leaves), [P()] * len(h_leaves), split, split),
        axis_names={stage_axis},
        check_vma=stack.check_vma,
    )(w_leaves, h_leaves, tables, inputs)
    grads = (d_w, d_h, pipeline.unmicrobatch(d_inputs, stage_axis))
    return total, grads, pipeline.layer_order_stats(stats, pp)


def _slots(a) -> P:
    """The layout of K slots of residual `a`: a's, behind a whole slot dim."""
    sharding = jax.typeof(a).sharding
    if sharding.mesh.empty:
        return None
    return P(None, *normalize(sharding.spec, a.ndim))
