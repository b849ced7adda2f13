"""Context parallelism: T split over a mesh axis (`context`), K/V gathered inside attention.

Dims as in the attention package: B batch, T queries, S keys, N / K query / kv heads, D head dim;
c = size of the context axis, C = T / (2c) tokens per chunk.

Chunk order. Causal attention gives late queries more keys than early ones, so c contiguous
slices of T would leave the device holding the first slice nearly idle while the last does
most of the work. The rows are therefore kept in *balanced* order while inside the model:
T is cut into 2c chunks and device i holds chunks i and 2c-1-i (one from the front, one from
the back), so every device has about the same number of visible query-key pairs. The order
is invisible outside: the decoder moves [B, T] inputs into it on the way in and the residual
back out before the LM head, so logits (and the loss's next-token shift, which then crosses
chunk borders like any other position) are in the natural order.

Nothing in the model depends on the order except through `positions` and `segment_ids`,
which travel with their tokens: RoPE reads global positions, and the mask (same segment,
key position <= query position) is the same whatever order the tokens sit in.

Attention, two ways (`DecoderConfig.context_parallel`), both inside `jax.shard_map`:

- `all_gather`: each device keeps its queries and all-gathers K, V, kv segment ids and
  positions over `context` (the backward pass reduce-scatters dK, dV), then runs the ordinary
  attention on its block: [B, T/c] queries against [B, T] keys, so the O(T^2) logits are 1/c
  per device but every device holds the whole row's K/V.
- `ring`: K/V blocks passed around the axis by collective-permutes, attended one at a time
  with a running log-sum-exp (ring.py): K/V memory 1/c too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from nnx_zoo.errors import UsageError
from shardings.mesh import compile_platform
from shardings.specs import normalize
from zoo.layers.attention import dispatch, ring
from zoo.layers.attention.choices import Choice, describe_call, record
from zoo.layers.attention.layout import reshard_to
from zoo.layers.attention.mask import Segments


def seq_axis(spec: P) -> str | None:
    """The mesh axis that dim 1 (T) of an activation layout is split over, or None."""
    entries = tuple(spec)
    if len(entries) < 2 or entries[1] is None:
        return None
    axis = entries[1]
    if isinstance(axis, tuple):
        if len(axis) != 1:
            raise ValueError(f"T may be split over one mesh axis, got {axis} in {spec}")
        axis = axis[0]
    return axis


def balanced_order(seq_len: int, context: int) -> np.ndarray:
    """Index t_natural for each balanced slot: `x_balanced = x[:, balanced_order(T, c)]`."""
    check_seq_len(seq_len, context)
    chunk = seq_len // (2 * context)
    order = []
    for i in range(context):
        order += [i, 2 * context - 1 - i]
    return np.concatenate([np.arange(k * chunk, (k + 1) * chunk) for k in order])


def check_seq_len(seq_len: int, context: int) -> None:
    if seq_len % (2 * context):
        raise UsageError(
            f"sequence length {seq_len} is split over mesh axis context={context} in 2x{context} "
            f"load-balanced chunks; use a sequence length that is a multiple of {2 * context}"
        )


def _live_spec(x: jax.Array) -> P:
    return normalize(jax.typeof(x).sharding.spec, x.ndim)


def _reorder(x: jax.Array, axis: str, *, to_balanced: bool) -> jax.Array:
    """Natural <-> balanced chunk order of dim 1 of `x` (split over `axis`): two
    collective-permutes over `axis`, each moving one of a device's two chunks.

    Natural: device i holds chunks 2i, 2i+1. Balanced: device j holds chunks j, 2c-1-j.
    Chunk k goes to device k (front half) if k < c, else to device 2c-1-k (back half).
    Splitting chunks by parity, each parity class is a permutation of the devices: even
    chunks land in the front of even devices and the back of odd ones, odd chunks the
    other way round.
    """
    c = jax.sharding.get_abstract_mesh().shape[axis]
    if c == 1:
        return x
    check_seq_len(x.shape[1], c)

    def dest(k: int) -> tuple[int, int]:  # natural chunk k -> (device, 0 front / 1 back)
        return (k, 0) if k < c else (2 * c - 1 - k, 1)

    even = [(i, dest(2 * i)[0]) for i in range(c)]
    odd = [(i, dest(2 * i + 1)[0]) for i in range(c)]
    spec = _live_spec(x)

    def local(x_local):
        half = x_local.shape[1] // 2
        j = jax.lax.axis_index(axis)
        first, second = x_local[:, :half], x_local[:, half:]
        if to_balanced:
            got_even = jax.lax.ppermute(first, axis, even)  # natural 2i -> device dest
            got_odd = jax.lax.ppermute(second, axis, odd)
            # Device j: its front chunk j has j's parity; its back chunk 2c-1-j the other.
            front = jnp.where(j % 2 == 0, got_even, got_odd)
            back = jnp.where(j % 2 == 0, got_odd, got_even)
            return jnp.concatenate([front, back], axis=1)
        # Inverse: the chunk of even natural index held by device j goes back to j's source.
        even_chunk = jnp.where(j % 2 == 0, first, second)
        odd_chunk = jnp.where(j % 2 == 0, second, first)
        back_even = jax.lax.ppermute(even_chunk, axis, [(d, s) for s, d in even])
        back_odd = jax.lax.ppermute(odd_chunk, axis, [(d, s) for s, d in odd])
        return jnp.concatenate([back_even, back_odd], axis=1)

    return jax.shard_map(local, in_specs=spec, out_specs=spec)(x)


def to_balanced(x: jax.Array, axis: str) -> jax.Array:
    """[B, T, ...] split over `axis` on T: natural -> balanced chunk order."""
    return _reorder(x, axis, to_balanced=True)


def from_balanced(x: jax.Array, axis: str) -> jax.Array:
    """[B, T, ...] split over `axis` on T: balanced -> natural chunk order."""
    return _reorder(x, axis, to_balanced=False)


def attention(
    q_BTND: jax.Array,
    k_BTKD: jax.Array,
    v_BTKD: jax.Array,
    *,
    segment_ids_BT: jax.Array,
    positions_BT: jax.Array,
    axis: str,
    scale: float,
    sliding_window: int | jax.Array | None,
    implementation: str,
    out_sharding: P | None,
    method: str = "all_gather",
    balanced: bool = True,
    interpret: bool = False,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Causal self-attention of a T-split block, each device's queries against every key:
    K/V (and their segment ids / positions) all-gathered over `axis` (`method='all_gather'`)
    or passed around it (`'ring'`). out_BTND keeps q's layout (then `out_sharding`).
    `balanced`: the rows are in balanced chunk order (the model's; the ring's splash blocks
    need it)."""
    if method not in ("all_gather", "ring"):
        raise UsageError(f"context_parallel={method!r}; valid: all_gather, ring")
    if sinks is not None and method == "ring":
        # The ring's running log-sum-exp would need the sink term; all_gather passes them on.
        raise UsageError(
            "attention sinks (GPT-OSS) under context_parallel='ring' are not supported; use "
            "context_parallel='all_gather' or a strategy without a context axis"
        )
    kernel = "xla"
    if method == "ring":
        c = jax.sharding.get_abstract_mesh().shape[axis]
        segments = Segments.self_attention(segment_ids_BT, positions_BT)
        what = describe_call(
            q_BTND,
            k_BTKD,
            segments,
            causal=True,
            sliding_window=sliding_window,
            site=f"context-parallel ring over {axis}={c}",
        )
        kernel, why = ring.block_kernel(
            implementation,
            dtype=q_BTND.dtype,
            head_dim=q_BTND.shape[-1],
            block_len=q_BTND.shape[1] // c,
            sliding_window=sliding_window,
            balanced=balanced,
            platform=compile_platform(),
            interpret=interpret,
            call=what,
        )
        record(Choice(what, implementation, kernel, why))
    q_spec, kv_spec = _live_spec(q_BTND), _live_spec(k_BTKD)
    tok_spec = P(q_spec[0], q_spec[1])
    static_window = sliding_window is None or isinstance(sliding_window, int | np.integer)

    def local(q, k, v, seg, pos, local_sinks, *window):
        if method == "ring":
            return ring.ring_attention(
                q,
                k,
                v,
                Segments(seg, seg, pos, pos),
                axis=axis,
                scale=scale,
                sliding_window=sliding_window if static_window else window[0],
                kernel=kernel,
                interpret=interpret,
            )
        gather = lambda x: jax.lax.all_gather(x, axis, axis=1, tiled=True)  # noqa: E731
        # Each device's T/c queries against all T keys: T != S, which index-masking kernels
        # (splash, cuDNN) cannot express: `auto` runs these calls on xla.
        return dispatch.attention(
            q,
            gather(k),
            gather(v),
            Segments(seg, gather(seg), pos, gather(pos)),
            scale=scale,
            out_sharding=None,
            causal=True,
            sliding_window=sliding_window if static_window else window[0],
            implementation=implementation,
            site=f"context-parallel all_gather block over {axis}",
            sinks=None if sinks is None else local_sinks,
        )

    args = [q_BTND, k_BTKD, v_BTKD, segment_ids_BT, positions_BT]
    specs = [q_spec, kv_spec, kv_spec, tok_spec, tok_spec]
    if not static_window:  # a per-layer window traced under the layer scan
        args.append(jnp.asarray(sliding_window, jnp.int32))
        specs.append(P())
    args = [reshard_to(x, s) for x, s in zip(args, specs, strict=True)]
    # Attention sinks [N] split as q's heads (each device's queries take their heads' sinks).
    sinks_spec = () if sinks is None else P(q_spec[2])
    args.insert(5, () if sinks is None else reshard_to(sinks, sinks_spec))
    specs.insert(5, sinks_spec)
    # Pallas kernels (the ring's splash blocks) carry no varying-axes types: unchecked.
    out_BTND = jax.shard_map(
        local, in_specs=tuple(specs), out_specs=q_spec, check_vma=kernel != "splash"
    )(*args)
    if out_sharding is not None:
        out_BTND = reshard_to(out_BTND, out_sharding)
    return out_BTND
