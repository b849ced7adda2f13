"""Ring attention: the keys and values of a T split over `context` visit every device in turn.

Dims as in the attention package: B batch, T local queries, S local keys (T = S = T_global / c),
K kv heads, G = N // K query heads per kv head, D head dim; c = size of the context axis.

Runs per device, inside the `jax.shard_map` of context_parallel.attention. Each device keeps
its queries; its K/V block (with the block's segment ids and positions) is passed to the next
device along the axis by a collective-permute, c - 1 times, so every device attends every
block once. The permute of the next block is issued before the current block's attention, so
the two can overlap; the steps between the first and the last are a `lax.scan`, so only one
step's temporaries are live at a time. Each block gives its softmax-normalised output and
its log-sum-exp per query; they are combined with a running log-sum-exp (online softmax):

    lse = logaddexp(lse_a, lse_b),  out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b

which is exactly softmax attention over the union of the blocks. The mask is the package's
rule (same segment, key position <= query position, window) applied per block, so documents
and causality hold whatever order the tokens sit in: the load-balanced chunk order of
context_parallel.py needs nothing here. Every block is computed whole (no index-based
skipping of the blocks a causal mask hides), so a padding query sees what it sees on one
device, and results equal the one-device run on every position.

The backward is a custom VJP, not autodiff through the ring: autodiff would keep every block
of K/V the forward received (c blocks: the all-gather's memory again) for the backward pass.
Here the forward keeps only its own q, k, v, the output and the log-sum-exp; the backward sends
K/V around the ring once more, and with them the running dK/dV of each block, which are back
on their home device after c hops. Per block, the probabilities are recomputed from the final
log-sum-exp, so the block's share of dq, dk, dv is exact (FlashAttention's backward).

Per-device memory: K/V of two blocks (the current and the incoming) instead of all c; the
XLA blocks' logits are [QUERY_CHUNK, S] at a time (all_gather's: [T, c S] at once).

Blocks are computed by einsums (`XlaBlocks`, every platform) or, on TPU, by the splash kernel
(ring_splash.py: index masks, so only in the load-balanced order, without a window). cuDNN
does not apply: its public call returns no log-sum-exp to combine blocks by and takes none
into its backward, so on GPU `auto` runs the blocks on XLA (and records why), and a named
`cudnn` is an error (`block_kernel`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from zoo.layers.attention.choices import NAMED, refusal
from zoo.layers.attention.mask import Segments, attention_mask, is_static
from zoo.layers.attention.registry import CallInfo, _why_unavailable, auto_choice, named_backend

# As the xla backend: finite, so a block where a query sees nothing gives a finite
# log-sum-exp (about this value), whose weight in the combination is then exp(-huge) = 0.
_MASKED_LOGIT = float(np.finfo(np.float32).min)


def ring_attention(
    q_BTND: jax.Array,
    k_BSKD: jax.Array,
    v_BSKD: jax.Array,
    segments: Segments,
    *,
    axis: str,
    scale: float,
    sliding_window,
    kernel: str = "xla",
    interpret: bool = False,
) -> jax.Array:
    """Causal self-attention of this device's queries over the keys of every device on
    `axis` (per-device arrays, inside shard_map). out_BTND in q's dtype. `kernel`: 'xla' or
    'splash' (see `block_kernel`)."""
    c = jax.sharding.get_abstract_mesh().shape[axis]
    static = is_static(sliding_window)
    window = None if static else jnp.asarray(sliding_window, jnp.int32)
    if kernel == "splash":
        from zoo.layers.attention.ring_splash import SplashBlocks

        blocks = SplashBlocks(scale=scale, context=c, axis=axis, interpret=interpret)
    else:
        blocks = XlaBlocks(scale, sliding_window if static else None)
    ring = _make_ring(c, axis, blocks)
    q_ids, kv_ids, q_pos, kv_pos = segments.arrays()
    return ring(q_BTND, k_BSKD, v_BSKD, q_ids, kv_ids, q_pos, kv_pos, window)


def block_kernel(
    implementation: str,
    *,
    dtype,
    head_dim: int,
    block_len: int,
    sliding_window,
    balanced: bool,
    platform: str,
    interpret: bool,
    call: str,
) -> tuple[str, str]:
    """('splash' | 'xla', why): the kernel of the ring's blocks of `block_len` local tokens.
    `auto` chooses; a backend named explicitly that cannot run the blocks raises UsageError
    naming `call` (the ring's call site), as the dispatcher does."""
    # The ring's smallest splash call is half a block.
    half = block_len // 2
    info = CallInfo(dtype, head_dim, half, half, platform, interpret)
    if implementation == "auto":
        name, why = auto_choice(info)
    else:
        reason = _why_unavailable(named_backend(implementation), info)
        if reason is not None:
            raise refusal(implementation, call, reason)
        name, why = implementation, NAMED
    reason = _no_ring_form(name, sliding_window, balanced)
    if reason is None:
        return name, why
    if implementation != "auto":
        raise refusal(implementation, call, reason)
    return "xla", f"auto: {name} {reason}"


def _no_ring_form(name: str, sliding_window, balanced: bool) -> str | None:
    """Why backend `name` cannot compute the ring's blocks, or None."""
    if name == "cudnn":
        return (
            "has no ring form: cuDNN's public call gives no log-sum-exp to combine K/V blocks "
            "by, and its backward takes none"
        )
    if name != "splash":
        return None
    from zoo.layers.attention import ring_splash

    if not (sliding_window is None or (is_static(sliding_window) and sliding_window <= 0)):
        return "runs the ring's blocks by index masks, which cannot say a sliding window"
    if not balanced:
        return "runs the ring's blocks by index masks, which need the balanced order"
    if not ring_splash.available():
        return "cannot take the ring's log-sum-exp into its backward in this jax version"
    return None


def _make_ring(c: int, axis: str, blocks):
    """The custom-VJP ring for one axis size and block kernel."""
    perm = [(j, (j + 1) % c) for j in range(c)]

    def send(x):
        return jax.lax.ppermute(x, axis, perm)

    def around(block, state, step_fn):
        """state after step_fn(step, block, state) for steps 0..c-1, where the block of step s
        is the one received after s hops. The permute of the next block is issued before each
        step's compute, so they can overlap; the middle steps are a loop (one step's
        temporaries live at a time), the last step sends no block on."""
        if c == 1:
            return step_fn(0, block, state)
        incoming = jax.tree.map(send, block)
        state = step_fn(0, block, state)
        if c > 2:

            def middle(carry, step):
                block, state = carry
                following = jax.tree.map(send, block)
                return (following, step_fn(step, block, state)), None

            steps = jnp.arange(1, c - 1, dtype=jnp.int32)
            (incoming, state), _ = jax.lax.scan(middle, (incoming, state), steps)
        return step_fn(c - 1, incoming, state)

    def forward(q, k, v, q_ids, kv_ids, q_pos, kv_pos, window):
        B, T, N, D = q.shape
        K = k.shape[2]
        q_BTKGD = q.reshape(B, T, K, N // K, D)

        def step_fn(step, block, state):
            out, lse = state
            k_b, v_b, ids_b, pos_b = block
            segments = Segments(q_ids, ids_b, q_pos, pos_b)
            out_b, lse_b = blocks.forward(step, q_BTKGD, k_b, v_b, segments, window)
            new = jnp.logaddexp(lse, lse_b)
            out = out * jnp.exp(lse - new)[..., None] + out_b * jnp.exp(lse_b - new)[..., None]
            return out, new

        start = (
            jnp.zeros(q_BTKGD.shape, jnp.float32),
            jnp.full(q_BTKGD.shape[:-1], -jnp.inf, jnp.float32),
        )
        return around((k, v, kv_ids, kv_pos), start, step_fn)

    @jax.custom_vjp
    def ring(q, k, v, q_ids, kv_ids, q_pos, kv_pos, window):
        out_BTKGD, _ = forward(q, k, v, q_ids, kv_ids, q_pos, kv_pos, window)
        return out_BTKGD.reshape(q.shape).astype(q.dtype)

    def ring_fwd(q, k, v, q_ids, kv_ids, q_pos, kv_pos, window):
        out_BTKGD, lse_BTKG = forward(q, k, v, q_ids, kv_ids, q_pos, kv_pos, window)
        out = out_BTKGD.reshape(q.shape).astype(q.dtype)
        return out, (q, k, v, q_ids, kv_ids, q_pos, kv_pos, window, out, lse_BTKG)

    def ring_bwd(res, dout_BTND):
        q, k, v, q_ids, kv_ids, q_pos, kv_pos, window, out, lse_BTKG = res
        B, T, N, D = q.shape
        K = k.shape[2]
        grouped = (B, T, K, N // K, D)
        q_BTKGD = q.reshape(grouped)
        dout_BTKGD = dout_BTND.reshape(grouped)
        # FlashAttention's D: rowsum(dO * O) per query and head, from the final output.
        delta_BTKG = jnp.sum(
            dout_BTKGD.astype(jnp.float32) * out.reshape(grouped).astype(jnp.float32), axis=-1
        )
        out_grouped = out.reshape(grouped)

        def step_fn(step, block, state):
            dq, (dk, dv) = state
            k_b, v_b, ids_b, pos_b = block
            segments = Segments(q_ids, ids_b, q_pos, pos_b)
            dq_b, dk_b, dv_b = blocks.backward(
                step,
                q_BTKGD,
                k_b,
                v_b,
                segments,
                window,
                out_grouped,
                lse_BTKG,
                dout_BTKGD,
                delta_BTKG,
            )
            # Each block's dK/dV travel with it, gathering what every device adds; after
            # the c-th hop they are home again.
            return dq + dq_b, jax.tree.map(send, (dk + dk_b, dv + dv_b))

        zeros = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
        start = (jnp.zeros(grouped, jnp.float32), zeros)
        dq, dkv = around((k, v, kv_ids, kv_pos), start, step_fn)
        dk, dv = dkv
        # Integer inputs (ids, positions, the window) have no cotangent.
        return (
            dq.reshape(q.shape).astype(q.dtype),
            dk.astype(k.dtype),
            dv.astype(v.dtype),
            None,
            None,
            None,
            None,
            None,
        )

    ring.defvjp(ring_fwd, ring_bwd)
    return ring


# XLA blocks run their queries in chunks of at most this many, one chunk at a time: a block's
# [T, S] float32 logits per head at 128k rows on 8 devices would be 16k x 16k (1 GiB a head);
# a chunk's are [QUERY_CHUNK, S]. (Splash never holds them: it tiles inside the kernel.)
QUERY_CHUNK = 1024


def _chunks(T: int) -> int:
    """How many equal query chunks of at most QUERY_CHUNK a block of T queries runs in."""
    n = -(-T // QUERY_CHUNK)
    while T % n:
        n += 1
    return n


class XlaBlocks:
    """The ring's per-step block attention by einsums: the whole block, masked by the rule,
    its queries in chunks (`QUERY_CHUNK`)."""

    def __init__(self, scale: float, static_window):
        self.scale, self.static_window = scale, static_window

    def _mask(self, segments, window):
        rule = self.static_window if window is None else window
        return attention_mask(segments, causal=True, sliding_window=rule)

    def forward(self, step, q_BTKGD, k_BSKD, v_BSKD, segments, window):
        del step  # every block is computed whole

        def one(q, q_ids, q_pos):
            seg = Segments(q_ids, segments.kv_ids_BS, q_pos, segments.kv_positions_BS)
            return _block_forward(q, k_BSKD, v_BSKD, self._mask(seg, window), self.scale)

        n = _chunks(q_BTKGD.shape[1])
        if n == 1:
            return one(q_BTKGD, segments.q_ids_BT, segments.q_positions_BT)
        chunked = _split((q_BTKGD, segments.q_ids_BT, segments.q_positions_BT), n)
        out, lse = jax.lax.map(lambda a: one(*a), chunked)
        return _join(out), _join(lse)

    def backward(self, step, q, k, v, segments, window, out, lse_BTKG, dout, delta_BTKG):
        del step, out  # delta carries what the output gives the backward

        def one(q, q_ids, q_pos, lse, dout, delta):
            seg = Segments(q_ids, segments.kv_ids_BS, q_pos, segments.kv_positions_BS)
            mask = self._mask(seg, window)
            return _block_backward(q, k, v, mask, self.scale, lse, dout, delta)

        per_query = (q, segments.q_ids_BT, segments.q_positions_BT, lse_BTKG, dout, delta_BTKG)
        n = _chunks(q.shape[1])
        if n == 1:
            return one(*per_query)

        def chunk(dkv, args):
            dq, dk, dv = one(*args)
            return (dkv[0] + dk, dkv[1] + dv), dq

        # zeros_like: typed as varying over the mesh axes as k and v are (a scan's carry
        # must keep its type).
        zeros = (jnp.zeros_like(k, jnp.float32), jnp.zeros_like(v, jnp.float32))
        (dk, dv), dq = jax.lax.scan(chunk, zeros, _split(per_query, n))
        return _join(dq), dk, dv


def _split(arrays, n):
    """[B, T, ...] arrays -> [n, B, T/n, ...]: n query chunks to loop over."""

    def split(x):
        B, T = x.shape[:2]
        return jnp.moveaxis(x.reshape(B, n, T // n, *x.shape[2:]), 1, 0)

    return jax.tree.map(split, arrays)


def _join(x):
    """[n, B, T/n, ...] -> [B, T, ...]."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], -1, *x.shape[3:])


def _logits(q_BTKGD, k_BSKD, mask_BTS, scale):
    """Masked, scaled float32 logits [B, K, G, T, S]."""
    logits = jnp.einsum("BTKGD,BSKD->BKGTS", q_BTKGD, k_BSKD, preferred_element_type=jnp.float32)
    return jnp.where(mask_BTS[:, None, None], logits * scale, _MASKED_LOGIT)


def _block_forward(q_BTKGD, k_BSKD, v_BSKD, mask_BTS, scale):
    """(out_BTKGD float32, softmax-normalised over this block's keys; lse_BTKG float32)."""
    logits = _logits(q_BTKGD, k_BSKD, mask_BTS, scale)
    max_BKGT = jnp.max(logits, axis=-1)
    unnormalised = jnp.exp(logits - max_BKGT[..., None])
    sum_BKGT = jnp.sum(unnormalised, axis=-1)
    probs = (unnormalised / sum_BKGT[..., None]).astype(v_BSKD.dtype)
    out_BTKGD = jnp.einsum("BKGTS,BSKD->BTKGD", probs, v_BSKD, preferred_element_type=jnp.float32)
    lse_BTKG = jnp.transpose(max_BKGT + jnp.log(sum_BKGT), (0, 3, 1, 2))
    return out_BTKGD, lse_BTKG


def _block_backward(q_BTKGD, k_BSKD, v_BSKD, mask_BTS, scale, lse_BTKG, dout_BTKGD, delta_BTKG):
    """This block's share of (dq_BTKGD, dk_BSKD, dv_BSKD), float32, given the softmax's final
    log-sum-exp over all blocks: P = exp(logits - lse) are the block's true probabilities."""
    logits = _logits(q_BTKGD, k_BSKD, mask_BTS, scale)
    lse_BKGT = jnp.transpose(lse_BTKG, (0, 2, 3, 1))
    probs = jnp.exp(logits - lse_BKGT[..., None])  # masked: exp(-huge) = 0
    dv = jnp.einsum(
        "BKGTS,BTKGD->BSKD",
        probs.astype(dout_BTKGD.dtype),
        dout_BTKGD,
        preferred_element_type=jnp.float32,
    )
    dprobs = jnp.einsum("BTKGD,BSKD->BKGTS", dout_BTKGD, v_BSKD, preferred_element_type=jnp.float32)
    delta_BKGT = jnp.transpose(delta_BTKG, (0, 2, 3, 1))
    dlogits = (probs * (dprobs - delta_BKGT[..., None]) * scale).astype(q_BTKGD.dtype)
    dq = jnp.einsum("BKGTS,BSKD->BTKGD", dlogits, k_BSKD, preferred_element_type=jnp.float32)
    dk = jnp.einsum("BKGTS,BTKGD->BSKD", dlogits, q_BTKGD, preferred_element_type=jnp.float32)
    return dq, dk, dv
