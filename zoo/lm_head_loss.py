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

import jax
import jax.numpy as jnp


def head_logits(x_BCM, weight, *, tied: bool, dtype, out_spec, softcap: float | None):
    """float32 logits `[B, C, V]` for hidden states `x_BCM`.

    `weight` is the LM head `[M, V]`, or with `tied` the embedding table `[V, M]`; both are
    cast to the compute `dtype` here, so the caller differentiates the float32 parameter.
    `softcap`: Gemma's `cap * tanh(z / cap)` on the final logits, or None.
    """
    eq = "BCM,VM->BCV" if tied else "BCM,MV->BCV"
    logits_BCV = jnp.einsum(
        eq, x_BCM.astype(dtype), weight.astype(dtype), out_sharding=out_spec
    ).astype(jnp.float32)
    if softcap:
        logits_BCV = softcap * jnp.tanh(logits_BCV / softcap)
    return logits_BCV


def chunk_nll(logits_BCV, targets_BC):
    """log-sum-exp minus the target's logit, per position, without a one-hot."""
    lse_BC = jax.nn.logsumexp(logits_BCV, axis=-1)
    sharding = jax.typeof(logits_BCV).sharding
    # The vocab ids, laid out like the logits: each shard compares only the ids it owns.
    spec = None if sharding.mesh.empty else sharding.spec
    vocab_ids_BCV = jax.lax.broadcasted_iota(jnp.int32, logits_BCV.shape, 2, out_sharding=spec)
    is_target_BCV = vocab_ids_BCV == targets_BC[..., None]
    target_logit_BC = jnp.sum(jnp.where(is_target_BCV, logits_BCV, 0.0), axis=-1)
    return lse_BC - target_logit_BC


def rows_per_device(x_BTM) -> int:
    """Rows of `x_BTM` each device holds: B over the mesh axes B is split on."""
    sharding = jax.typeof(x_BTM).sharding
    spec = tuple(sharding.spec) + (None,)
    axes = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
    shards = 1
    for axis in axes:
        if axis is not None:
            shards *= sharding.mesh.shape[axis]
    return max(1, x_BTM.shape[0] // shards)


def chunk_positions(x_BTM, chunk_size: int) -> int:
    """Positions per chunk C for `chunk_size` tokens per device per chunk: a chunk covers
    every row (rows stay where the batch layout puts them), so a device holds its
    rows x C tokens of logits at a time."""
    T = x_BTM.shape[1]
    return max(1, min(T, chunk_size // rows_per_device(x_BTM)))


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

    `logits_fn(x_BCM, weight)` gives float32 logits `[B, C, V]`, laid out like the full ones.
    T need not divide by C: the last chunk is padded with masked positions.
    """
    B, T, M = x_BTM.shape
    C = chunk_positions(x_BTM, chunk_size)
    n = -(-T // C)
    pad = n * C - T
    if pad:
        x_BTM = jnp.pad(x_BTM, ((0, 0), (0, pad), (0, 0)))
        targets_BT = jnp.pad(targets_BT, ((0, 0), (0, pad)))
    # Chunks lead so the scan walks them; rows keep their layout inside each chunk.
    x_nBCM = jnp.moveaxis(x_BTM.reshape(B, n, C, M), 1, 0)
    targets_nBC = jnp.moveaxis(targets_BT.reshape(B, n, C), 1, 0)

    # Saves nothing: the backward pass recomputes this chunk's logits from its inputs.
    @jax.checkpoint
    def one_chunk(weight, x_BCM, targets_BC):
        return chunk_nll(logits_fn(x_BCM, weight), targets_BC)

    def step(carry, xs):
        return carry, one_chunk(weight, *xs)

    _, nll_nBC = jax.lax.scan(step, None, (x_nBCM, targets_nBC), unroll=_unroll(x_BTM))
    nll_BT = jnp.moveaxis(nll_nBC, 0, 1).reshape(B, n * C)[:, :T]
    return jnp.where(mask_BT, nll_BT, 0.0)
