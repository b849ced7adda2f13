"""The LM head fused with next-token cross-entropy, walked over chunks of positions.

`[B, T, V]` float32 logits are the largest activation of a training step at large
vocabularies (Llama 3: V = 128256, 4 GiB per 8192 tokens), and the plain path keeps them,
plus a one-hot of the same size, for the backward pass. Here a scan over chunks of C
positions computes one chunk's logits `[B, C, V]`, reduces them to the log-sum-exp and the
target logit, and drops them; the backward pass recomputes one chunk's logits at a time.

Its gradient is written by hand (`_chunks_nll`, a custom VJP), because what autodiff of a
rematerialised chunk compiles to moves ~4x the bytes (llama3_1b, 8 x 2048 tokens, compiled
for H100: 120 GB per step of memory-bound traffic in the head, against 30 GB here; docs/speed.md):

- the weight is cast to the compute dtype once, not once per chunk in the backward pass;
- the forward pass keeps each position's log-sum-exp (4 bytes a token), so the backward
  pass turns the recomputed logits into their gradient `softmax - one_hot` in one
  elementwise pass, without the max and sum reductions again;
- both matmuls produce float32 (`preferred_element_type`), so the logits are not rounded
  to bf16 before the softmax, and the weight gradient accumulates across chunks in the
  float32 carry, an addition XLA fuses into the GEMM (no separate pass over `[V, M]`);
- except where the weight is split on an axis the tokens are split on (FSDP's `M/data`):
  there each chunk's weight gradient is a sum over devices, reduce-scattered into the
  weight's shards, and its GEMM produces the compute dtype, as every other weight's
  gradient under FSDP does, before the float32 sum over chunks. A float32 GEMM output
  there costs a full float32 `[M, V]` per device: XLA adds the chunks' partial sums before
  reducing them, and on TPU reduces them with an all-reduce of the whole head, where the
  compute-dtype GEMM is fused with its reduce-scatter into a windowed loop that never
  holds the unreduced `[M, V]` (docs/planning.md, "The LM head's gradient under FSDP").

Exact under every layout: with the vocab split (`V/model`), the log-sum-exp's max and sum
are reductions over a split dim, which XLA completes across the shards; the target logit is
a masked sum in which only the shard that owns the target id contributes. Nothing of size V
is built besides the chunk's logits (the comparison with the vocab ids fuses into the sum).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from shardings.specs import axes_of, entry_size, normalize, split_size


@dataclasses.dataclass(frozen=True)
class Head:
    """How hidden states become logits (`head_logits`' arguments besides x and the weight):
    hashable, so the chunked loss's custom VJP can take it as a static argument."""

    tied: bool  # the weight is the embedding table `[V, M]`, not a head `[M, V]`
    dtype: Any  # the compute dtype both matmul operands are cast to
    out_spec: Any  # the logits' PartitionSpec `[B, T, V]`, or None outside a mesh
    softcap: float | None = None  # Gemma's `cap * tanh(z / cap)`, or None
    vocab_size: int | None = None  # columns from here on are padding (None: none are)

    def logits(self, x_BCM, weight):
        return head_logits(
            x_BCM,
            weight,
            tied=self.tied,
            dtype=self.dtype,
            out_spec=self.out_spec,
            softcap=self.softcap,
            vocab_size=self.vocab_size,
        )


def head_logits(
    x_BCM,
    weight,
    *,
    tied: bool,
    dtype,
    out_spec,
    softcap: float | None,
    vocab_size: int | None = None,
):
    """float32 logits `[B, C, V]` for hidden states `x_BCM` (`out_spec`: their layout).

    A chunk of a sequence-split row comes as `[B, S, C, M]` (S: the T shards); its logits
    `[B, S, C, V]` take `out_spec`'s T split on S.

    `weight` is the LM head `[M, V]`, or with `tied` the embedding table `[V, M]`; both are
    cast to the compute `dtype` here, so the caller differentiates the float32 parameter.
    The matmul accumulates and returns float32 whatever `dtype` is.
    `softcap`: Gemma's `cap * tanh(z / cap)` on the final logits, or None. Columns from
    `vocab_size` on (a padded vocab's; None: all are tokens) are set to the lowest float32,
    so they weigh nothing in a softmax or log-sum-exp, an argmax never picks them, and no
    gradient reaches them.
    """
    raw_BCV = _raw_logits(x_BCM, weight.astype(dtype), tied, out_spec)
    return _finish(raw_BCV, softcap, vocab_size)


def _raw_logits(x_BCM, weight, tied: bool, out_spec):
    """float32 `x @ weight` (before any soft-cap), the weight already in the compute dtype."""
    eq = "...M,VM->...V" if tied else "...M,MV->...V"
    if out_spec is not None and x_BCM.ndim == 4:
        out_spec = P(*tuple(out_spec)[:2], None, *tuple(out_spec)[2:])
    return _head_einsum(x_BCM.astype(weight.dtype), weight, eq, out_spec)


def _finish(raw_BCV, softcap: float | None, vocab_size: int | None):
    """The raw logits soft-capped, and the padding columns set to the lowest float32."""
    logits_BCV = softcap * jnp.tanh(raw_BCV / softcap) if softcap else raw_BCV
    if vocab_size is not None and logits_BCV.shape[-1] > vocab_size:
        logits_BCV = jnp.where(
            _vocab_ids(logits_BCV) < vocab_size, logits_BCV, jnp.finfo(jnp.float32).min
        )
    return logits_BCV


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _head_einsum(x, w, eq, out_spec):
    """float32 `einsum(eq, x, w)` whose weight gradient is computed as a dot of (x, g), which
    comes out in the weight's own dim order. JAX's own transpose rule computes dot(g, x),
    `[V, M]` for an `[M, V]` head, then transposes: in a chunk loop XLA then keeps the
    float32 accumulator in the transposed layout and copies it back to the weight's after
    the loop (the compiled 8B step on TPU: two float32 copies of the head's shard, and a
    layout copy of each chunk's bf16 logit gradient). The incoming float32 gradient is cast
    to the operands' dtype first, so both gradient matmuls run in it."""
    return jnp.einsum(eq, x, w, out_sharding=out_spec, preferred_element_type=jnp.float32)


def _head_einsum_fwd(x, w, eq, out_spec):
    return _head_einsum(x, w, eq, out_spec), (x, w)


def _head_einsum_bwd(eq, out_spec, residuals, g):
    x, w = residuals
    dx_eq, dw_eq = _grad_equations(eq, x.ndim)
    # Each gradient in its primal's layout (a weight split on M gets its reduce-scatter).
    x_spec, w_spec = (None, None) if out_spec is None else (_spec(x), _spec(w))
    g = g.astype(x.dtype)
    dx = jnp.einsum(dx_eq, g, w, out_sharding=x_spec)
    dw = jnp.einsum(dw_eq, x, g, out_sharding=w_spec)
    return dx, dw


def _grad_equations(eq: str, x_ndim: int) -> tuple[str, str]:
    """(dx, dw) einsum equations of `eq` = 'x,w->out': dx = 'out,w->x', dw = 'x,out->w'."""
    lhs, rhs = eq.split("->")[0].split(",")
    out = eq.split("->")[1]
    # Spell the leading dims out: `...` cannot be summed away in an einsum's output.
    lead = "abcdefgh"[: x_ndim - len(lhs.replace("...", ""))]
    lhs, out = lhs.replace("...", lead), out.replace("...", lead)
    return f"{out},{rhs}->{lhs}", f"{lhs},{out}->{rhs}"


def _spec(x):
    sharding = jax.typeof(x).sharding
    return None if sharding.mesh.empty else sharding.spec


_head_einsum.defvjp(_head_einsum_fwd, _head_einsum_bwd)


def _vocab_ids(logits_BCV):
    """The vocab id of every logit, laid out like the logits: each shard builds only the ids
    it owns (nothing of size V is materialised; the comparisons fuse)."""
    sharding = jax.typeof(logits_BCV).sharding
    spec = None if sharding.mesh.empty else sharding.spec
    last = logits_BCV.ndim - 1
    return jax.lax.broadcasted_iota(jnp.int32, logits_BCV.shape, last, out_sharding=spec)


def drop_vocab_padding(logits_BTV, vocab_size: int):
    """`logits_BTV[..., :vocab_size]`: the true vocabulary's logits of a padded head.

    The padded V is split over devices and the true one need not divide, so the columns are
    gathered (V whole on every device) before the slice; without padding, nothing happens.
    """
    if logits_BTV.shape[-1] == vocab_size:
        return logits_BTV
    sharding = jax.typeof(logits_BTV).sharding
    if not sharding.mesh.empty:
        *leading, _ = normalize(sharding.spec, logits_BTV.ndim)
        logits_BTV = jax.sharding.reshard(logits_BTV, P(*leading, None))
    return logits_BTV[..., :vocab_size]


def _logsumexp_and_target(logits_BCV, targets_BC):
    """(log-sum-exp, the target's logit) per position, in ONE pass over the logits: a
    reduction whose accumulator is (running max m, sum of exp(z - m), target logit), the
    online softmax's. `jax.nn.logsumexp` reads the logits twice (max, then sum), and the
    target logit a third time; at a large vocabulary each pass is the size of the logits
    (llama3_1b, 8 x 2048 tokens: 8.4 GB a pass). No one-hot is built: the comparison with
    the vocab ids fuses into the reduction."""
    is_target_BCV = _vocab_ids(logits_BCV) == targets_BC[..., None]
    lowest = np.float32(np.finfo(np.float32).min)  # not -inf: exp(-inf - -inf) is nan

    def combine(a, b):
        (max_a, sum_a, target_a), (max_b, sum_b, target_b) = a, b
        m = jnp.maximum(max_a, max_b)
        return m, sum_a * jnp.exp(max_a - m) + sum_b * jnp.exp(max_b - m), target_a + target_b

    max_BC, sum_BC, target_BC = jax.lax.reduce(
        (logits_BCV, jnp.ones_like(logits_BCV), jnp.where(is_target_BCV, logits_BCV, 0.0)),
        (lowest, np.float32(0.0), np.float32(0.0)),
        combine,
        (logits_BCV.ndim - 1,),
    )
    return max_BC + jnp.log(sum_BC), target_BC


def chunk_nll(logits_BCV, targets_BC):
    """log-sum-exp minus the target's logit, per position, without a one-hot: the plain
    differentiable form (the pipeline's 1F1B loop differentiates it as it runs; the chunked
    loss above has its own backward)."""
    lse_BC = jax.nn.logsumexp(logits_BCV, axis=-1)
    is_target_BCV = _vocab_ids(logits_BCV) == targets_BC[..., None]
    target_logit_BC = jnp.sum(jnp.where(is_target_BCV, logits_BCV, 0.0), axis=-1)
    return lse_BC - target_logit_BC


def rows_per_device(x_BTM) -> int:
    """Rows of `x_BTM` each device holds: B over the mesh axes B is split on."""
    sharding = jax.typeof(x_BTM).sharding
    return max(1, x_BTM.shape[0] // split_size(sharding.spec, 0, sharding.mesh.shape))


def seq_shards(x_BTM) -> tuple[tuple[str, ...], int]:
    """(mesh axes T is split on, their total size S; 1 when T is whole)."""
    sharding = jax.typeof(x_BTM).sharding
    entry = normalize(sharding.spec, 2)[1]
    return axes_of(entry), entry_size(entry, sharding.mesh.shape)


def chunk_positions(x_BTM, chunk_size: int) -> int:
    """Positions per chunk C for `chunk_size` tokens per device per chunk: a chunk covers
    every row (rows stay where the batch layout puts them) and, with T split, every T
    shard, so a device holds its rows x C tokens of logits at a time."""
    local_T = x_BTM.shape[1] // seq_shards(x_BTM)[1]
    return max(1, min(local_T, chunk_size // rows_per_device(x_BTM)))


def _unroll(x) -> bool:
    """Whether to unroll the chunk loop: only on a CPU mesh of several devices.

    There XLA's runtime can deadlock: with collectives inside a loop and independent ones
    outside it, devices may reach them in different orders (seen with fsdp_tp on 8 CPU
    devices). Unrolled, the result is the same, but XLA may then schedule the chunks side
    by side, so the memory saving holds on TPU / GPU and on one CPU device, not there.
    """
    mesh = jax.typeof(x).sharding.mesh
    device = getattr(mesh, "abstract_device", None)
    return mesh.size > 1 and device is not None and device.platform == "cpu"


def chunked_token_nll(x_BTM, weight, targets_BT, mask_BT, head: Head, chunk_size: int):
    """Per-position NLL `[B, T]` (0 where `mask_BT` is False), over chunks of about
    `chunk_size` tokens per device.

    `head` says how `x` and `weight` make float32 logits `[B, C, V]` (or `[B, S, C, V]`),
    laid out like the full ones (`Head.logits`). T need not divide by C: the last chunk is
    padded with masked positions. With T split over S devices (context parallelism) each
    device walks its own T/S positions: a chunk is `[B, S, C]`, split on S as T was.
    """
    B, T, M = x_BTM.shape
    sharding = jax.typeof(x_BTM).sharding
    spec = (*tuple(sharding.spec), None, None)[:3]
    seq_axes, S = seq_shards(x_BTM)
    Tl = T // S
    seq = seq_axes or None
    if sharding.mesh.empty:
        x_BSTM = x_BTM.reshape(B, S, Tl, M)
        targets_BST = targets_BT.reshape(B, S, Tl)
    else:
        x_BSTM = jnp.reshape(x_BTM, (B, S, Tl, M), out_sharding=P(spec[0], seq, None, None))
        targets_BST = jnp.reshape(targets_BT, (B, S, Tl), out_sharding=P(spec[0], seq, None))
    C = chunk_positions(x_BTM, chunk_size)
    n = -(-Tl // C)
    pad = n * C - Tl
    if pad:
        x_BSTM = jnp.pad(x_BSTM, ((0, 0), (0, 0), (0, pad), (0, 0)))
        targets_BST = jnp.pad(targets_BST, ((0, 0), (0, 0), (0, pad)))
    # Chunks lead so the scan walks them; rows (and T shards) keep their layout in each.
    x_nBSCM = jnp.moveaxis(x_BSTM.reshape(B, S, n, C, M), 2, 0)
    targets_nBSC = jnp.moveaxis(targets_BST.reshape(B, S, n, C), 2, 0)
    if S == 1:  # the common case stays [B, C, ...]
        x_nBSCM, targets_nBSC = x_nBSCM[:, :, 0], targets_nBSC[:, :, 0]

    nll = _chunks_nll(head, _unroll(x_BTM), x_nBSCM, weight, targets_nBSC)
    if S == 1:
        nll = nll[:, :, None]
    nll_BST = jnp.moveaxis(nll, 0, 2).reshape(B, S, n * C)[:, :, :Tl]
    if sharding.mesh.empty:
        nll_BT = nll_BST.reshape(B, T)
    else:
        nll_BT = jnp.reshape(nll_BST, (B, T), out_sharding=jax.typeof(mask_BT).sharding.spec)
    return jnp.where(mask_BT, nll_BT, 0.0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _chunks_nll(head: Head, unroll: bool, x_nBCM, weight, targets_nBC):
    """NLL `[n, B, C]` of every chunk (`[n, B, S, C, M]` inputs with T split: `[n, B, S,
    C]`), the scan over chunks `n` forward and backward written out (the module doc says
    why)."""
    return _chunks_nll_fwd(head, unroll, x_nBCM, weight, targets_nBC)[0]


def _chunks_nll_fwd(head: Head, unroll: bool, x_nBCM, weight, targets_nBC):
    weight_c = weight.astype(head.dtype)  # once: every chunk, forward and backward, reads it

    def step(_, xs):
        x_BCM, targets_BC = xs
        raw_BCV = _raw_logits(x_BCM, weight_c, head.tied, head.out_spec)
        logits_BCV = _finish(raw_BCV, head.softcap, head.vocab_size)
        lse_BC, target_logit_BC = _logsumexp_and_target(logits_BCV, targets_BC)
        return None, (lse_BC - target_logit_BC, lse_BC)

    _, (nll_nBC, lse_nBC) = jax.lax.scan(step, None, (x_nBCM, targets_nBC), unroll=unroll)
    return nll_nBC, (x_nBCM, weight, weight_c, targets_nBC, lse_nBC)


def _chunks_nll_bwd(head: Head, unroll: bool, residuals, g_nBC):
    x_nBCM, weight, weight_c, targets_nBC, lse_nBC = residuals
    eq = "...M,VM->...V" if head.tied else "...M,MV->...V"
    dx_eq, dw_eq = _grad_equations(eq, x_nBCM.ndim - 1)
    # Each gradient in its primal's layout (a weight split on M gets its reduce-scatter).
    w_spec = None if head.out_spec is None else _spec(weight)

    # The dtype each chunk's weight gradient leaves its GEMM in (module docstring: float32,
    # unless the gradient is reduce-scattered across devices, as under FSDP).
    gathered = _gathered(head, x_nBCM, weight)
    dw_dtype = weight_c.dtype if gathered else jnp.float32

    def chunk_grads(xs):
        x_BCM, targets_BC, lse_BC, g_BC = xs
        w_c = weight_c
        if gathered:
            # A weight gathered whole for the chunks' matmuls is gathered again per chunk
            # here: the barrier (tying it to the chunk, as jax.checkpoint ties a rematerialised
            # function's inputs) keeps XLA from reusing the forward pass's gathered copy,
            # which it would otherwise hold from the forward pass through this one (remat's
            # trade, memory for one more all-gather of the head; docs/planning.md).
            weight_b, x_BCM = jax.lax.optimization_barrier((weight, x_BCM))
            w_c = weight_b.astype(head.dtype)
        x_BCM = x_BCM.astype(w_c.dtype)
        raw_BCV = _raw_logits(x_BCM, w_c, head.tied, head.out_spec)
        dlogits_BCV = _logits_grad(head, raw_BCV, targets_BC, lse_BC, g_BC).astype(head.dtype)
        x_spec = None if head.out_spec is None else _spec(x_BCM)
        dx_BCM = jnp.einsum(dx_eq, dlogits_BCV, w_c, out_sharding=x_spec)
        dw = jnp.einsum(
            dw_eq, x_BCM, dlogits_BCV, out_sharding=w_spec, preferred_element_type=dw_dtype
        )
        return dx_BCM, dw.astype(jnp.float32)

    def step(dw_acc, xs):
        dx_BCM, dw = chunk_grads(xs)
        # Accumulated in float32 whatever the compute dtype; XLA folds the addition into the
        # GEMM (its output fusion / cuBLAS's beta = 1), so it costs no pass of its own.
        return dw_acc + dw, dx_BCM

    # The first chunk's weight gradient starts the sum: a zero-filled float32 accumulator
    # would be one more write of the whole weight.
    xs = (x_nBCM, targets_nBC, lse_nBC, g_nBC)
    dx_BCM, dw = chunk_grads(jax.tree.map(lambda a: a[0], xs))
    if x_nBCM.shape[0] > 1:
        dw, dx_nBCM = jax.lax.scan(step, dw, jax.tree.map(lambda a: a[1:], xs), unroll=unroll)
        dx_nBCM = jnp.concatenate([dx_BCM[None], dx_nBCM])
    else:
        dx_nBCM = dx_BCM[None]
    return dx_nBCM.astype(x_nBCM.dtype), dw.astype(weight.dtype), None


def _gathered(head: Head, x_nBCM, weight) -> bool:
    """Whether the weight is split on a mesh axis the tokens are split on (FSDP's `M/data`
    with rows on `data`): each device then gathers it whole for its tokens' matmuls, and its
    gradient, a sum over every device's tokens, is reduce-scattered into its shards."""
    if head.out_spec is None:
        return False
    x_axes = {a for entry in _spec(x_nBCM) for a in axes_of(entry)}
    return any(a in x_axes for entry in _spec(weight) for a in axes_of(entry))


def _logits_grad(head: Head, raw_BCV, targets_BC, lse_BC, g_BC):
    """d(g * nll) / d(raw logits): `g * (softmax - one_hot)`, through the soft-cap; 0 in
    the padding columns. One elementwise pass over the chunk's logits (the forward pass's
    log-sum-exp gives the softmax without a reduction)."""
    logits_BCV = raw_BCV
    if head.softcap:
        tanh_BCV = jnp.tanh(raw_BCV / head.softcap)
        logits_BCV = head.softcap * tanh_BCV
    vocab_ids = _vocab_ids(raw_BCV)
    probs_BCV = jnp.exp(logits_BCV - lse_BC[..., None])
    if head.vocab_size is not None and raw_BCV.shape[-1] > head.vocab_size:
        probs_BCV = jnp.where(vocab_ids < head.vocab_size, probs_BCV, 0.0)
    one_hot_BCV = (vocab_ids == targets_BC[..., None]).astype(jnp.float32)
    dlogits_BCV = (probs_BCV - one_hot_BCV) * g_BC[..., None]
    if head.softcap:
        dlogits_BCV = dlogits_BCV * (1.0 - tanh_BCV * tanh_BCV)
    return dlogits_BCV


_chunks_nll.defvjp(_chunks_nll_fwd, _chunks_nll_bwd)
