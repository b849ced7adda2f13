"""The LM head fused with next-token cross-entropy, walked over chunks of positions.

`[B, T, V]` float32 logits are the largest activation of a training step at large
vocabularies (Llama 3: V = 128256, 4 GiB per 8192 tokens), and the plain path keeps them,
plus a one-hot of the same size, for the backward pass. Here a scan over chunks of C
positions computes one chunk's logits `[B, C, V]`, reduces them to the log-sum-exp and the
target logit, and drops them; the chunk body is rematerialised, so the backward pass
recomputes one chunk's logits at a time too. The head weight's gradient accumulates across
chunks in float32 (the scan's carry), whatever the compute dtype.

Exact under every layout: with the vocab split (`V/model`), the log-sum-exp's max and sum
are reductions over a split dim, which XLA completes across the shards; the target logit is
a masked sum in which only the shard that owns the target id contributes. Nothing of size V
is built besides the chunk's logits (the comparison with the vocab ids fuses into the sum).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from shardings.specs import axes_of, entry_size, normalize, split_size


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
    `softcap`: Gemma's `cap * tanh(z / cap)` on the final logits, or None. Columns from
    `vocab_size` on (a padded vocab's; None: all are tokens) are set to the lowest float32,
    so they weigh nothing in a softmax or log-sum-exp, an argmax never picks them, and no
    gradient reaches them.
    """
    eq = "...M,VM->...V" if tied else "...M,MV->...V"
    if out_spec is not None and x_BCM.ndim == 4:
        out_spec = P(*tuple(out_spec)[:2], None, *tuple(out_spec)[2:])
    logits_BCV = _head_einsum(x_BCM.astype(dtype), weight.astype(dtype), eq, out_spec).astype(
        jnp.float32
    )
    if softcap:
        logits_BCV = softcap * jnp.tanh(logits_BCV / softcap)
    if vocab_size is not None and logits_BCV.shape[-1] > vocab_size:
        logits_BCV = jnp.where(
            _vocab_ids(logits_BCV) < vocab_size, logits_BCV, jnp.finfo(jnp.float32).min
        )
    return logits_BCV


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _head_einsum(x, w, eq, out_spec):
    """`einsum(eq, x, w)` whose weight gradient is computed as a dot of (x, g), which comes
    out in the weight's own dim order. JAX's own transpose rule computes dot(g, x), `[V, M]`
    for an `[M, V]` head, then transposes: in the chunk loop XLA then keeps the float32
    accumulator in the transposed layout and copies it back to the weight's after the loop
    (the compiled 8B step on TPU: two float32 copies of the head's shard, and a layout copy
    of each chunk's bf16 logit gradient)."""
    return jnp.einsum(eq, x, w, out_sharding=out_spec)


def _head_einsum_fwd(x, w, eq, out_spec):
    return _head_einsum(x, w, eq, out_spec), (x, w)


def _head_einsum_bwd(eq, out_spec, residuals, g):
    x, w = residuals
    lhs, rhs = eq.split("->")[0].split(",")
    out = eq.split("->")[1]
    # Spell the leading dims out: `...` cannot be summed away in an einsum's output.
    lead = "abcdefgh"[: x.ndim - len(lhs.replace("...", ""))]
    lhs, out = lhs.replace("...", lead), out.replace("...", lead)
    # Each gradient in its primal's layout (a weight split on M gets its reduce-scatter).
    x_spec, w_spec = (None, None) if out_spec is None else (_spec(x), _spec(w))
    dx = jnp.einsum(f"{out},{rhs}->{lhs}", g, w, out_sharding=x_spec)
    dw = jnp.einsum(f"{lhs},{out}->{rhs}", x, g, out_sharding=w_spec)
    return dx, dw


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


def chunk_nll(logits_BCV, targets_BC):
    """log-sum-exp minus the target's logit, per position, without a one-hot."""
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


def chunked_token_nll(x_BTM, weight, targets_BT, mask_BT, logits_fn, chunk_size: int):
    """Per-position NLL `[B, T]` (0 where `mask_BT` is False), over chunks of about
    `chunk_size` tokens per device.

    `logits_fn(x, weight)` gives float32 logits `[B, C, V]` (or `[B, S, C, V]`), laid out
    like the full ones. T need not divide by C: the last chunk is padded with masked
    positions. With T split over S devices (context parallelism) each device walks its own
    T/S positions: a chunk is `[B, S, C]`, split on S as T was.
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

    # Saves nothing: the backward pass recomputes this chunk's logits from its inputs.
    @jax.checkpoint
    def one_chunk(weight, x_chunk, targets_chunk):
        return chunk_nll(logits_fn(x_chunk, weight), targets_chunk)

    def step(carry, xs):
        return carry, one_chunk(weight, *xs)

    _, nll = jax.lax.scan(step, None, (x_nBSCM, targets_nBSC), unroll=_unroll(x_BTM))
    if S == 1:
        nll = nll[:, :, None]
    nll_BST = jnp.moveaxis(nll, 0, 2).reshape(B, S, n * C)[:, :, :Tl]
    if sharding.mesh.empty:
        nll_BT = nll_BST.reshape(B, T)
    else:
        nll_BT = jnp.reshape(nll_BST, (B, T), out_sharding=jax.typeof(mask_BT).sharding.spec)
    return jnp.where(mask_BT, nll_BT, 0.0)
