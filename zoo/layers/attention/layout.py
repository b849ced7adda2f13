"""The layout fix for black-box kernels, and the xla path's layouts of its intermediates.

Custom calls (cuDNN, Pallas splash) carry no sharding types under an explicit mesh; `per_shard`
runs them per device inside `jax.shard_map` so their outputs (and gradients) keep their
declared layouts. `plan_layout` derives every intermediate's spec from q's layout.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from shardings.specs import axes_of, entry_size, normalize
from zoo.layers.attention.mask import Segments, is_static


def per_shard(fn, q_BTND, k_BSKD, v_BSKD, segments, sliding_window, **options):
    """The layout fix: run a black-box backend inside jax.shard_map over batch and heads.

    A custom call's abstract values carry no sharding outside shard_map: the cuDNN call's
    output *and* the q/k/v gradients of its custom_vjp come back typed unsharded, although q,
    k, v were `B/data T N/model D`. Forward, an out-projection that names its output layout
    then silently all-gathers the whole attention output onto every device; one that does not
    (fsdp_tp kernel `N/model D M/data`) returns `B T M/data`, and the next op that meets a
    declared layout fails at trace time with a ShardingTypeError (`dot_general requires
    contracting dimensions to have consistent sharding, got ('data',) and ('model',)`, or
    `add got incompatible shardings` at the residual). `jax.sharding.reshard(out, spec)`
    after the call fixes only the forward. Backward, jax rejects the unsharded gradients
    against the sharded primal inputs (`Custom VJP bwd rule must produce an output with the
    same type as the args tuple of the primal function`), which no reshard after the call can
    reach. Inside shard_map every device runs the call on its own `B/data`, `N/model` block (a
    plain local attention: heads and batch rows are independent), types are per-device and
    consistent in both directions, and out_specs gives the result its layout back. Pallas
    kernels (splash) are the same kind of black box, and need `check_vma=False` there.

    Sequence dims are gathered: the kernels mask by index, which would be wrong on a block of
    queries. Heads split as the xla path splits them (`plan_layout`), so each device holds
    the kv heads of its query heads.
    """
    lay = plan_layout(q_BTND, k_BSKD, split_queries=False)
    args = [
        reshard_to(q_BTND, lay.q),
        reshard_to(k_BSKD, lay.kv),
        reshard_to(v_BSKD, lay.kv),
        reshard_segments(segments, lay),
    ]
    specs = [
        lay.q,
        lay.kv,
        lay.kv,
        Segments(lay.q_tokens, lay.kv_tokens, lay.q_tokens, lay.kv_tokens, segments.packed),
    ]
    # Attention sinks [N] split as q's heads: each device's kernel takes its heads' sinks.
    sinks = options.pop("sinks", None)
    args.append(() if sinks is None else reshard_to(sinks, P(tuple(lay.q)[2])))
    specs.append(() if sinks is None else P(tuple(lay.q)[2]))
    static = is_static(sliding_window)
    if not static:  # a traced per-layer window enters as an argument, replicated
        args.append(jnp.asarray(sliding_window, jnp.int32))
        specs.append(P())

    def local(q, k, v, segs, local_sinks, *window):
        extra = {} if sinks is None else {"sinks": local_sinks}
        return fn(
            q,
            k,
            v,
            segs,
            sliding_window=sliding_window if static else window[0],
            out_sharding=None,  # no explicit axes inside: layouts are shard_map's
            **options,
            **extra,
        )

    return jax.shard_map(local, in_specs=tuple(specs), out_specs=lay.out, check_vma=False)(*args)


def reshard_segments(segments: Segments, lay) -> Segments:
    return Segments(
        reshard_to(segments.q_ids_BT, lay.q_tokens),
        reshard_to(segments.kv_ids_BS, lay.kv_tokens),
        reshard_to(segments.q_positions_BT, lay.q_tokens),
        reshard_to(segments.kv_positions_BS, lay.kv_tokens),
        segments.packed,
    )


@dataclasses.dataclass(frozen=True)
class Layout:
    """Specs of the xla path's intermediates under an explicit mesh, derived from q's layout.

    Heads stay split the way q's are: on the kv-head dim K when K divides over the head
    axis (MHA, GQA), on the group dim G when K == 1 (MQA, kv replicated), else q's heads
    are gathered. jax.nn.dot_product_attention(implementation='xla') vmaps over G, which
    fails for MQA under tensor parallelism ("Mapped away dimension of inputs passed to
    vmap should be sharded the same"), hence einsums with explicit out_sharding here.
    """

    q: P  # [B, T, N, D]
    kv: P  # [B, S, K, D]
    q_tokens: P  # [B, T]
    kv_tokens: P  # [B, S]
    grouped: P  # [B, T, K, G, D], q and the output before merging heads
    logits: P  # [B, K, G, T, S]
    out: P  # [B, T, N, D]


def explicit_axes() -> frozenset[str]:
    mesh = jax.sharding.get_abstract_mesh()
    return frozenset() if mesh.empty else frozenset(mesh.explicit_axes)


def keep_explicit(entry, explicit: frozenset[str]):
    kept = tuple(n for n in axes_of(entry) if n in explicit)
    if not kept:
        return None
    return kept[0] if len(kept) == 1 else kept


def axis_size(entry) -> int:
    if entry is None:
        return 1
    return entry_size(entry, jax.sharding.get_abstract_mesh().shape)


def plan_layout(
    q_BTND: jax.Array, k_BSKD: jax.Array, *, split_queries: bool = True
) -> Layout | None:
    explicit = explicit_axes()
    if not explicit:
        return None
    q_spec = tuple(normalize(jax.typeof(q_BTND).sharding.spec, 4))
    k_spec = tuple(normalize(jax.typeof(k_BSKD).sharding.spec, 4))
    qb, qt, heads = (keep_explicit(e, explicit) for e in q_spec[:3])
    if not split_queries:
        qt = None
    kv_heads_now = keep_explicit(k_spec[2], explicit)
    K = k_BSKD.shape[2]
    if heads is None:
        kv_heads, group = None, None
    elif K == 1:
        kv_heads, group = None, heads  # MQA: every device needs the one kv head
    elif kv_heads_now == heads or K % axis_size(heads) == 0:
        # A K split over the head axis keeps each device's q heads next to their kv heads;
        # from replicated kv that is a local slice, no communication.
        kv_heads, group = heads, None
    else:
        # Head counts that do not split evenly into groups: gather q's heads (rare; no
        # strategy here makes it, since the model axis is chosen to divide K).
        heads, kv_heads, group = None, None, None
    # The key sequence dim is gathered (context parallelism is not supported here) and D is
    # never split: both are contracted or reduced within a device.
    return Layout(
        q=P(qb, qt, heads, None),
        kv=P(qb, None, kv_heads, None),
        q_tokens=P(qb, qt),
        kv_tokens=P(qb, None),
        grouped=P(qb, qt, kv_heads, group, None),
        logits=P(qb, kv_heads, group, qt, None),
        out=P(qb, qt, heads, None),
    )


def reshard_to(x: jax.Array, spec: P) -> jax.Array:
    """reshard only when the layout differs, so the common case adds nothing to the graph."""
    now, want = normalize(jax.typeof(x).sharding.spec, x.ndim), normalize(spec, x.ndim)
    return x if now == want else jax.sharding.reshard(x, want)
