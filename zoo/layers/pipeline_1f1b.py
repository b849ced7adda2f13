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
   (stage weights, final norm, head, the embedded rows), accumulated in the loop's carry;
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
the backward slices it again from the loop-invariant stack, so no slot holds weights. The
backward walks the layers in reverse and adds each layer's weight gradient into its slice of
the loop's sums in place, so no stage-sized gradient exists per micro-batch.

Costs against GPipe, both stated in docs/pipeline-1f1b.md: the LM head and loss run on the
last stage for every micro-batch (GPipe runs them after the loop on each stage's own rows,
1/S of them), and every stage runs that code in SPMD (its result is used on the last stage
only), so a step's critical path gains (Mb - Mb/S) micro-batches' head forward and backward.
The weight gradients accumulate in the weights' compute dtype over micro-batches, as
`jax.grad` through GPipe's loop does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from shardings.specs import axes_of, normalize
from zoo.layers import pipeline, quant
from zoo.layers.attention import Segments
from zoo.lm_head_loss import Head, chunk_nll, chunked_token_nll


def nll_sum(model, x_BTM, segments: Segments, targets_BT, mask_BT, chunk_size: int):
    """The next-token NLL of `model` (a DecoderLM under a pipeline strategy) summed over
    `mask_BT`, from its embedded rows `x_BTM` (split over (batch axes, stage)), whose
    gradient the 1F1B loop computes as it runs.

    `chunk_size` > 0 runs the LM head fused with the loss over chunks (zoo/lm_head_loss.py)."""
    cfg, sharding = model.cfg, model.sharding
    stage_axis = sharding.stage_axis
    pp = pipeline.plan_for(cfg, sharding, jax.sharding.get_abstract_mesh())
    windows, freqs_LR = model._layer_tables()
    # Matmul weights cast to the compute dtype once, before the loop (as GPipe's).
    graphdef, weights = nnx.split(model._compute_dtype_blocks())
    w_leaves, w_def = jax.tree.flatten(weights)
    norm_def, norm_state = nnx.split(model.final_norm)
    n_leaves, n_def = jax.tree.flatten(norm_state)
    head_w, head = model._head()
    # Inside the loop the rows are split over the batch axes but `stage`.
    inner_norm = _without_axis(sharding.final_norm.out, stage_axis)
    _, inner_head = model._head(out_spec=_without_axis(sharding.lm_head.out, stage_axis))

    def final_norm(n_leaves, y, out_sharding=None):
        norm = nnx.merge(norm_def, jax.tree.unflatten(n_def, n_leaves))
        return norm(y, out_sharding=out_sharding)

    @jax.custom_vjp
    def summed(w_leaves, n_leaves, head_w, x_BTM, ids_BT, pos_BT, targets_BT, mask_BT):
        # Not differentiated (evaluation): the GPipe forward, then the head and the loss on
        # each stage's own rows.
        weights = jax.tree.unflatten(w_def, w_leaves)
        seg = Segments.self_attention(ids_BT, pos_BT, packed=segments.packed)
        y = pipeline.run_stack(
            cfg, pp, stage_axis, graphdef, weights, x_BTM, seg, windows, freqs_LR
        )
        h = final_norm(n_leaves, y)
        return _summed_nll(h, head_w, targets_BT, mask_BT, head, chunk_size)

    def summed_fwd(w_leaves, n_leaves, head_w, x_BTM, ids_BT, pos_BT, targets_BT, mask_BT):
        loop = _Loop(
            cfg, sharding, pp, graphdef, w_def, windows, freqs_LR, segments.packed, chunk_size
        )
        total, grads = loop.run(
            w_leaves,
            n_leaves,
            head_w,
            x_BTM,
            (ids_BT, pos_BT, targets_BT, mask_BT),
            final_norm=lambda n, y: final_norm(n, y, inner_norm),
            head=inner_head,
        )
        return total, grads

    def summed_bwd(grads, g):
        # The loss is a sum: its cotangent g scales every gradient the loop computed.
        scaled = jax.tree.map(lambda d: (d * g).astype(d.dtype), grads)
        return (*scaled, None, None, None, None)

    summed.defvjp(summed_fwd, summed_bwd)
    return summed(
        w_leaves,
        n_leaves,
        head_w,
        x_BTM,
        segments.q_ids_BT,
        segments.q_positions_BT,
        targets_BT,
        mask_BT,
    )


def _summed_nll(h_BTM, head_w, targets_BT, mask_BT, head: Head, chunk_size: int):
    """sum over `mask_BT` of the next-token NLL of the final-normed `h_BTM`."""
    with jax.named_scope("lm_head_loss"):
        if chunk_size:
            nll_BT = chunked_token_nll(h_BTM, head_w, targets_BT, mask_BT, head, chunk_size)
        else:
            nll_BT = jnp.where(mask_BT, chunk_nll(head.logits(h_BTM, head_w), targets_BT), 0.0)
        return jnp.sum(nll_BT)


def _without_axis(spec, axis: str) -> P:
    """`spec` with `axis` taken out of its first (rows) entry: the layout inside the
    pipeline's shard_map, which is manual over `axis`."""
    entries = list(tuple(spec))
    rest = tuple(a for a in axes_of(entries[0]) if a != axis)
    entries[0] = rest[0] if len(rest) == 1 else (rest or None)
    return P(*entries)


class _Residuals:
    """How a stage forward's pullback is kept between its forward and its backward: its
    leaves that are not the stage's weights go into ring buffers, the weights stay where they
    are. `split` records, per leaf, the weight leaf it is (or None); `join` rebuilds the
    pullback from the ring's leaves and the weights."""

    def __init__(self):
        self.layout = None  # (kinds, avals) of the first trace; every later one must match

    def split(self, pullback, weight_leaves):
        leaves, treedef = jax.tree.flatten(pullback)
        index = {id(w): i for i, w in enumerate(weight_leaves)}
        kinds = tuple(index.get(id(leaf)) for leaf in leaves)
        saved = [leaf for leaf, k in zip(leaves, kinds, strict=True) if k is None]
        layout = (kinds, tuple((a.shape, a.dtype) for a in saved))
        if self.layout is None:
            self.layout = layout
        elif layout != self.layout:
            # The ring is written by one trace of the stage's forward and read by another:
            # their residuals must be the same list.
            raise AssertionError("1F1B: a stage forward's residuals differ between traces")
        return saved, treedef

    def join(self, treedef, saved, weight_leaves):
        kinds, _ = self.layout
        it = iter(saved)
        leaves = [next(it) if k is None else weight_leaves[k] for k in kinds]
        return jax.tree.unflatten(treedef, leaves)


class _Loop:
    """The 1F1B loop of one step: forward and backward of every micro-batch through every
    stage, the head and the loss on the last, gradients accumulated."""

    def __init__(self, cfg, sharding, pp, graphdef, w_def, windows, freqs_LR, packed, chunk_size):
        self.cfg, self.sharding, self.pp, self.w_def = cfg, sharding, pp, w_def
        self.windows, self.freqs_LR = windows, freqs_LR
        self.packed, self.chunk_size = packed, chunk_size
        self.graphdef = graphdef

    def run(self, w_leaves, n_leaves, head_w, x_BTM, rows, *, final_norm, head):
        """(summed loss, (weight leaves' grads, norm leaves' grads, head grad, x_BTM's grad)).

        `rows`: (ids, positions, targets, mask), each `[B, T]` like `x_BTM`'s rows."""
        cfg, stage_axis = self.cfg, self.sharding.stage_axis
        mesh = jax.sharding.get_abstract_mesh()
        pp = self.pp
        S, Mb, Lc = pp.stages, pp.microbatches, pp.layers_per_chunk
        K = pp.in_flight  # ring slots: stage 0's micro-batches in flight, 2S-1
        pipeline.check_batch(
            x_BTM.shape[0],
            pp,
            pipeline.data_shards(jax.typeof(x_BTM).sharding.spec[0], stage_axis, mesh),
        )
        windows_SRL, freqs_SRLR = pipeline.layer_tables(
            cfg, self.windows, self.freqs_LR, pp, stage_axis
        )
        call = pipeline.block_call_fn(self.graphdef, self.windows)
        policy = pipeline.stage_policy(cfg, mesh)
        # [Mb, B/Mb, ...], Mb over `stage`: stage s holds micro-batches s*n .. (s+1)*n - 1.
        inputs = pipeline.microbatch(x_BTM, Mb, stage_axis)
        rows = tuple(pipeline.microbatch(a, Mb, stage_axis) for a in rows)
        forward_ring = [(s, (s + 1) % S) for s in range(S)]
        backward_ring = [(s, (s - 1) % S) for s in range(S)]
        residuals = _Residuals()
        w_def, packed, chunk_size = self.w_def, self.packed, self.chunk_size

        def local(w_leaves, n_leaves, head_w, inputs, rows, windows_SRL, freqs_SRLR):
            s = jax.lax.axis_index(stage_axis)
            last = s == S - 1
            windows_L, freqs_LR = windows_SRL[0, 0], freqs_SRLR[0, 0]  # [1, 1, Lc] -> [Lc]
            # Stage 0 feeds the pipeline (only its buffers are read); the ids, positions,
            # targets and mask travel with the activations.
            feed = tuple(pipeline.to_stage_0(a, stage_axis, S) for a in (inputs, *rows))

            def layer_weights(j):
                """Layer j's weights, sliced from the stage's loop-invariant stack."""
                return jax.tree.unflatten(
                    w_def, [jax.lax.dynamic_index_in_dim(w, j, 0, False) for w in w_leaves]
                )

            def stage_forward(x, ids_m, pos_m):
                """(y, residuals stacked over the stage's layers, the pullbacks' treedef):
                each layer's forward as `jax.vjp` under the remat policy; its weight slice,
                a residual of its pullback, is not kept (the backward slices it again)."""
                seg = Segments.self_attention(ids_m, pos_m, packed=packed)
                treedefs = []

                def one(x, j):
                    @functools.partial(jax.checkpoint, policy=policy)
                    def layer(w, x):
                        return call(w, x, seg, windows_L[j], freqs_LR[j])

                    w = layer_weights(j)
                    with quant.unquantized_residuals():
                        y, pullback = jax.vjp(layer, w, x)
                    saved, treedef = residuals.split(pullback, jax.tree.leaves(w))
                    treedefs.append(treedef)
                    return y, saved

                y, saved = jax.lax.scan(one, x, jnp.arange(Lc))
                return y, saved, treedefs[0]

            def stage_backward(cot, saved, treedef, d_weights):
                """The stage's backward from its output's cotangent: layer by layer in
                reverse, each layer's weight gradient added into its slice of `d_weights`
                (the loop's sums, updated in place), the input's cotangent out."""

                def one(carry, xs):
                    d_x, d_weights = carry
                    saved_j, j = xs
                    w = layer_weights(j)
                    d_w, d_x = residuals.join(treedef, saved_j, jax.tree.leaves(w))(d_x)
                    d_weights = [
                        jax.lax.dynamic_update_index_in_dim(
                            acc, jax.lax.dynamic_index_in_dim(acc, j, 0, False) + d, j, 0
                        )
                        for acc, d in zip(d_weights, jax.tree.leaves(d_w), strict=True)
                    ]
                    return (d_x, d_weights), None

                (d_x, d_weights), _ = jax.lax.scan(
                    one, (cot, d_weights), (saved, jnp.arange(Lc)), reverse=True
                )
                return d_x, d_weights

            # Shapes of the ring's slots, from a trace whose results nothing reads (XLA
            # drops its work): the stage's forward on the first micro-batch's shapes.
            _, saved0, treedef0 = stage_forward(*(f[0] for f in feed[:3]))
            ring0 = tuple(jnp.zeros((K, *a.shape), a.dtype, out_sharding=_slots(a)) for a in saved0)

            def forward_half(carry, t):
                """Forward of micro-batch t - s: its residuals into the ring, its output
                (and the rows' ids, positions, targets, mask) on to the next stage."""
                state, ring = carry["state"], carry["ring"]
                m = t - s

                def mine(buf, received):
                    own = jax.lax.dynamic_index_in_dim(buf, m % Mb, 0, keepdims=False)
                    return jnp.where(s == 0, own, received)

                x, *row_m = (mine(b, st) for b, st in zip(feed, state, strict=True))
                y, saved, treedef = stage_forward(x, row_m[0], row_m[1])
                # Slot m mod K: any slot written while m is in flight belongs to a
                # micro-batch at most 2S-2 apart, so none is live (bubble iterations
                # included, whose m < 0 or m >= Mb).
                ring = tuple(
                    jax.lax.dynamic_update_index_in_dim(r, v, m % K, 0)
                    for r, v in zip(ring, saved, strict=True)
                )
                sent = jax.lax.ppermute((y, *row_m), stage_axis, forward_ring)
                return {**carry, "state": sent, "ring": ring}, (y, row_m, treedef)

            def backward_half(carry, t, treedef, seed_BTM):
                """Backward of micro-batch t - (2S-2-s) from the cotangent the next stage
                sent (the last stage: `seed_BTM`, its loss's, when given); its weight
                gradients into the sums, its input's cotangent to the previous stage (stage 0:
                into the rows' gradient)."""
                m = t - (2 * S - 2 - s)
                valid = (m >= 0) & (m < Mb)
                cot = carry["cot"] if seed_BTM is None else jnp.where(last, seed_BTM, carry["cot"])
                # Bubble iterations: a zero cotangent, so they add exact zeros.
                cot = jnp.where(valid, cot, jnp.zeros_like(cot))
                saved = [
                    jax.lax.dynamic_index_in_dim(r, m % K, 0, keepdims=False) for r in carry["ring"]
                ]
                d_x, d_weights = stage_backward(cot, saved, treedef, carry["d_weights"])
                slot = m % Mb
                old = jax.lax.dynamic_index_in_dim(carry["d_inputs"], slot, 0, keepdims=False)
                d_inputs = jax.lax.dynamic_update_index_in_dim(
                    carry["d_inputs"], jnp.where(valid & (s == 0), d_x, old), slot, 0
                )
                sent = jax.lax.ppermute(d_x, stage_axis, backward_ring)
                return {**carry, "cot": sent, "d_weights": d_weights, "d_inputs": d_inputs}

            def warmup(carry, t):
                carry, _ = forward_half(carry, t)
                return carry, None

            def steady(carry, t):
                carry, (y, row_m, treedef) = forward_half(carry, t)
                # The last stage finishes micro-batch t - (S-1): final norm, head, loss, and
                # their gradients; every other stage computes the same on its own output,
                # seeded with 0, so only the last stage's count.
                targets_m, mask_m = row_m[2], row_m[3]

                def head_loss(n_leaves, head_w, y):
                    h = final_norm(n_leaves, y)
                    return _summed_nll(h, head_w, targets_m, mask_m, head, chunk_size)

                loss_m, head_pullback = jax.vjp(head_loss, n_leaves, head_w, y)
                d_norm, d_head, seed = head_pullback(last.astype(loss_m.dtype))
                carry = {
                    **carry,
                    "loss": carry["loss"] + jnp.where(last, loss_m, 0.0),
                    "d_norm": jax.tree.map(jnp.add, carry["d_norm"], d_norm),
                    "d_head": carry["d_head"] + d_head,
                }
                return backward_half(carry, t, treedef, seed), None

            def cooldown(carry, t):
                return backward_half(carry, t, treedef0, None), None

            # Each loop carries only what it uses, so no buffer lives longer than it must.
            fwd = {"state": tuple(jnp.zeros_like(f[0]) for f in feed), "ring": ring0}
            fwd, _ = jax.lax.scan(warmup, fwd, jnp.arange(S - 1))
            sums = {
                "cot": jnp.zeros_like(feed[0][0]),
                "d_weights": [jnp.zeros_like(w) for w in w_leaves],
                "d_norm": [jnp.zeros_like(n) for n in n_leaves],
                "d_head": jnp.zeros_like(head_w),
                "loss": jnp.zeros((), jnp.float32),
                "d_inputs": jnp.zeros_like(feed[0]),
            }
            carry, _ = jax.lax.scan(steady, {**fwd, **sums}, jnp.arange(S - 1, Mb + S - 1))
            del carry["state"]
            carry, _ = jax.lax.scan(cooldown, carry, jnp.arange(Mb + S - 1, Mb + 2 * S - 2))

            # The head, norm and loss counted on the last stage only: summed over `stage`
            # (the all-reduce data parallelism over `stage` needs for them under GPipe too).
            total = jax.lax.psum(carry["loss"], stage_axis)
            d_norm = [jax.lax.psum(d, stage_axis) for d in carry["d_norm"]]
            d_head = jax.lax.psum(carry["d_head"], stage_axis)
            d_inputs = pipeline.from_stage_0(carry["d_inputs"], s, stage_axis, S)
            return total, carry["d_weights"], d_norm, d_head, d_inputs

        split = P(stage_axis)
        total, d_w, d_norm, d_head, d_inputs = jax.shard_map(
            local,
            in_specs=(
                [split] * len(w_leaves),
                [P()] * len(n_leaves),
                P(),
                split,
                (split,) * len(rows),
                split,
                split,
            ),
            out_specs=(P(), [split] * len(w_leaves), [P()] * len(n_leaves), P(), split),
            axis_names={stage_axis},
            # As GPipe's: attention kernels with their own unchecked shard_map nest inside.
            check_vma=False,
        )(w_leaves, n_leaves, head_w, inputs, rows, windows_SRL, freqs_SRLR)
        d_x = pipeline.unmicrobatch(d_inputs, stage_axis)
        return total, (d_w, d_norm, d_head, d_x)


def _slots(a) -> P:
    """The layout of K slots of residual `a`: a's, behind a whole slot dim."""
    sharding = jax.typeof(a).sharding
    if sharding.mesh.empty:
        return None
    return P(None, *normalize(sharding.spec, a.ndim))
