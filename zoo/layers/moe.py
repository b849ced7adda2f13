"""Mixture-of-experts feed-forward: a top-k router and SwiGLU experts stacked on an E dim.

Every token is computed by exactly the k experts its router picks: nothing is dropped, so
there is no capacity factor. The expert compute sorts the token-to-expert assignments by
expert and runs `jax.lax.ragged_dot` over the sorted rows, one contiguous group per expert.
Why this form: it is dropless whatever the routing (one expert may receive every token), and
on TPU and GPU XLA lowers ragged_dot to grouped-matmul kernels whose FLOPs follow the group
sizes, i.e. are proportional to top-k, not E. The alternatives each lose one of these: a
capacity-bounded dispatch tensor ([E, C, M], Switch/GShard) drops overflow tokens, and a
dense loop over all experts costs E/k times the FLOPs. XLA's CPU backend, however, expands
ragged_dot into a masked matmul over every group (E/k times the FLOPs), so CPU runs of an MoE
are slower than their active size suggests; bench/moe_throughput.py measures it.

The sort and the ragged_dot run inside `jax.shard_map`, so each device sorts only its own
tokens. With an expert axis (`fsdp_ep`) each device holds E/e experts: after sorting, the
rows bound for each expert shard are sent there by one all-to-all over the expert axis,
sorted again by local expert, computed, and sent back by a second all-to-all. The send
buffers are [e, X, M] (X = local assignments), room for the worst case in which every local
token picks experts of one shard, so the exchange is dropless at the price of e times the
bytes of a ragged exchange.

Router: softmax over all E experts in float32, top k, then (Mixtral always, Qwen3-MoE when
`norm_topk_prob`) renormalised over the k. The load-balancing loss is transformers' form
(Switch Transformer eq. 4-6, as its `load_balancing_loss_func` computes it over all layers):
E * sum_e (assignments to e / tokens) * (mean router probability of e), padding excluded.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from nnx_zoo.errors import UsageError
from shardings.mesh import compile_platform
from shardings.specs import MoeSharding, normalize
from zoo.layers.basic import Einsum, _normal
from zoo.layers.grouped_matmul import grouped_matmul, resolve_matmul
from zoo.layers.moe_exchange import (
    packet_rows,
    padded_exchange,
    ragged_exchange,
    resolve_exchange,
)


class RouterStats(NamedTuple):
    """One layer's routing, summed over its counted (non-padding) tokens."""

    counts: jax.Array  # [E] top-k assignments per expert
    probs: jax.Array  # [E] router probabilities per expert
    tokens: jax.Array  # tokens counted
    # Assignments (padding included) the exchange dropped, and all of them: counts, not a
    # share, so that sums over a pipeline's micro-batches stay exact.
    dropped: jax.Array
    assigned: jax.Array

    @property
    def dropped_share(self) -> jax.Array:
        return self.dropped / jnp.maximum(self.assigned, 1.0)


class MoeStats(NamedTuple):
    """The whole model's routing: what the training loss and the metrics use."""

    aux_loss: jax.Array  # transformers' load-balancing loss (unweighted)
    load: jax.Array  # [L, E] share of each layer's assignments that went to each expert
    dropped: jax.Array  # share of the assignments dropped (capacity-bounded exchange; else 0)


def zero_stats(num_experts: int) -> RouterStats:
    """One layer's `RouterStats`, all zero: the start of a sum over micro-batches."""
    scalar = jnp.zeros((), jnp.float32)
    E = jnp.zeros((num_experts,), jnp.float32)
    return RouterStats(counts=E, probs=E, tokens=scalar, dropped=scalar, assigned=scalar)


def moe_stats(stats: RouterStats, num_experts: int) -> MoeStats:
    """Per-layer sums ([L, E], [L, E], [L]) -> the model's aux loss and per-layer loads.

    transformers sums counts and probabilities over all layers first and divides by the
    total rows (tokens x layers) once, so the loss is not a mean of per-layer losses.
    """
    rows = jnp.maximum(jnp.sum(stats.tokens), 1.0)
    tokens_per_expert_E = jnp.sum(stats.counts, axis=0) / rows
    prob_per_expert_E = jnp.sum(stats.probs, axis=0) / rows
    aux = num_experts * jnp.sum(tokens_per_expert_E * prob_per_expert_E)
    per_layer = jnp.maximum(jnp.sum(stats.counts, axis=-1, keepdims=True), 1.0)
    dropped = jnp.sum(stats.dropped) / jnp.maximum(jnp.sum(stats.assigned), 1.0)
    return MoeStats(aux_loss=aux, load=stats.counts / per_layer, dropped=dropped)


def route(logits_BTE, k: int, norm_topk_prob: bool):
    """(weights_BTk, experts_BTk, probs_BTE): the top-k experts and their mixing weights."""
    probs_BTE = jax.nn.softmax(logits_BTE.astype(jnp.float32), axis=-1)
    weights_BTk, experts_BTk = jax.lax.top_k(probs_BTE, k)
    if norm_topk_prob:
        weights_BTk = weights_BTk / jnp.sum(weights_BTk, axis=-1, keepdims=True)
    return weights_BTk, experts_BTk, probs_BTE


def swiglu_experts(
    x_XM, gate_EMF, up_EMF, down_EFM, group_sizes_E, biases=(), act=None, matmul="ragged_dot"
):
    """Rows of x sorted by expert, `group_sizes_E[e]` of them for expert e (rows past the
    groups' total come out zero) -> each row through its expert's SwiGLU.

    `biases`: () or the experts' (gate [E, F], up [E, F], down [E, M]) biases, each row
    taking its expert's. `act(g, u)`: the gated activation (None: silu(g) * u). `matmul`:
    the grouped matmul's form (zoo/layers/grouped_matmul.py)."""
    g_XF = grouped_matmul(x_XM, gate_EMF, group_sizes_E, matmul)
    u_XF = grouped_matmul(x_XM, up_EMF, group_sizes_E, matmul)
    if biases:
        expert_X = _row_experts(group_sizes_E, x_XM.shape[0])
        gate_b, up_b, down_b = (_per_row(b, expert_X).astype(g_XF.dtype) for b in biases)
        g_XF, u_XF = g_XF + gate_b, u_XF + up_b
    h_XF = jax.nn.silu(g_XF) * u_XF if act is None else act(g_XF, u_XF)
    y_XM = grouped_matmul(h_XF, down_EFM, group_sizes_E, matmul)
    return y_XM + down_b.astype(y_XM.dtype) if biases else y_XM


def clamped_swiglu(alpha: float, limit: float):
    """GPT-OSS's activation, as transformers' GptOssExperts applies it: the gate clamped
    above at `limit`, up to [-limit, limit], then gate * sigmoid(alpha * gate) * (up + 1)."""

    def act(g_XF, u_XF):
        g_XF = jnp.minimum(g_XF, limit)
        u_XF = jnp.clip(u_XF, -limit, limit)
        return g_XF * jax.nn.sigmoid(g_XF * alpha) * (u_XF + 1)

    return act


def _row_experts(group_sizes_E, rows: int):
    """[X] each sorted row's expert; E for rows past the groups' total."""
    return jnp.searchsorted(jnp.cumsum(group_sizes_E), jnp.arange(rows), side="right")


def _per_row(bias_E_, expert_X):
    """Each row's expert's bias; zero for rows past the groups (expert E), which must stay zero."""
    padded = jnp.concatenate([bias_E_, jnp.zeros_like(bias_E_[:1])])
    return padded[expert_X]


def _local_moe(
    x_BTM,
    experts_BTk,
    weights_BTk,
    gate_EMF,
    up_EMF,
    down_EFM,
    biases=(),
    *,
    num_experts: int,
    expert_axis: str | None,
    ffn_axis: str | None,
    scatter_out: bool,
    exchange: str,
    capacity_factor: float,
    packet_rows: int,
    act=None,
    matmul: str = "ragged_dot",
):
    """One device's tokens through their experts (runs inside shard_map): (y_BTM, [1] the
    assignments this device's exchange dropped). `biases`, `act` as in `swiglu_experts`."""
    B, T, M = x_BTM.shape
    k = experts_BTk.shape[-1]
    x_NM = x_BTM.reshape(B * T, M)
    expert_X = experts_BTk.reshape(-1)  # X = N * k assignments, token-major
    order_X = jnp.argsort(expert_X, stable=True)
    token_X = (jnp.arange(expert_X.shape[0]) // k)[order_X]
    x_XM = x_NM[token_X]
    counts_E = jnp.bincount(expert_X, length=num_experts).astype(jnp.int32)

    if biases and ffn_axis is not None:
        # F split: each device's down projection is a partial sum, reduced below; the down
        # bias joins only one of them.
        gate_b, up_b, down_b = biases
        first = jax.lax.axis_index(ffn_axis) == 0
        biases = (gate_b, up_b, jnp.where(first, down_b, jnp.zeros_like(down_b)))

    def experts(rows_XM, group_sizes_E):
        return swiglu_experts(
            rows_XM,
            gate_EMF,
            up_EMF,
            down_EFM,
            group_sizes_E,
            biases=biases,
            act=act,
            matmul=matmul,
        )

    dropped = jnp.zeros((), jnp.int32)
    if expert_axis is None:
        y_XM = experts(x_XM, counts_E)
    elif exchange == "ragged":
        y_XM, dropped = ragged_exchange(x_XM, counts_E, experts, expert_axis, packet_rows)
    else:
        y_XM, dropped = padded_exchange(x_XM, counts_E, experts, expert_axis, capacity_factor)
    y_XM = y_XM * weights_BTk.reshape(-1)[order_X][:, None].astype(y_XM.dtype)
    y_NM = jnp.zeros_like(x_NM).at[token_X].add(y_XM)  # the k experts' outputs summed
    y_BTM = y_NM.reshape(B, T, M)
    if ffn_axis is not None:
        # F split over `ffn_axis`: each device holds a partial sum of the down projection.
        if scatter_out:
            y_BTM = jax.lax.psum_scatter(y_BTM, ffn_axis, scatter_dimension=2, tiled=True)
        else:
            y_BTM = jax.lax.psum(y_BTM, ffn_axis)
    return y_BTM, dropped[None]


class Moe(nnx.Module):
    def __init__(self, cfg, sharding: MoeSharding, *, rngs: nnx.Rngs):
        M, E, F = cfg.hidden_dim, cfg.num_experts, cfg.moe_ffn_dim
        if cfg.activation != "silu" or not cfg.glu:
            raise UsageError("MoE experts are SwiGLU: needs activation='silu' and glu=True")
        self.act = (
            clamped_swiglu(cfg.swiglu_alpha, cfg.swiglu_limit)
            if cfg.moe_activation == "clamped_swiglu"
            else None
        )
        self.sharding = sharding
        self.num_experts = E
        self.k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.dtype = cfg.compute_dtype
        self.exchange = cfg.moe_exchange
        self.matmul = cfg.moe_matmul
        self.capacity_factor = cfg.moe_capacity_factor
        self.router = Einsum(
            "BTM,ME->BTE",
            (M, E),
            sharding.router,
            rngs=rngs,
            dtype=self.dtype,
            use_bias=cfg.moe_bias,
        )

        def param(shape, spec):
            return nnx.Param(_normal(rngs, shape, spec), out_sharding=spec)

        self.gate = param((E, M, F), sharding.gate)
        self.up = param((E, M, F), sharding.up)
        self.down = param((E, F, M), sharding.down)
        if cfg.moe_bias:

            def bias(shape, spec):
                return nnx.Param(
                    jnp.zeros(shape, jnp.float32, out_sharding=spec), out_sharding=spec
                )

            self.gate_bias = bias((E, F), sharding.gate_bias)
            self.up_bias = bias((E, F), sharding.gate_bias)
            self.down_bias = bias((E, M), sharding.down_bias)
        else:
            self.gate_bias = self.up_bias = self.down_bias = None

    def route(self, x_BTM):
        """(weights_BTk, experts_BTk, probs_BTE): softmax routing. A router of another form
        (zoo/layers/moe_grouped.py: DeepSeek-V3's) overrides this; the exchange is shared."""
        return route(self.router(x_BTM), self.k, self.norm_topk_prob)

    def __call__(self, x_BTM, mask_BT):
        """(y_BTM, RouterStats); `mask_BT` marks the tokens the statistics count."""
        s = self.sharding
        weights_BTk, experts_BTk, probs_BTE = self.route(x_BTM)
        mask_BT = mask_BT.astype(jnp.float32)
        one_hot_BTE = jnp.sum(jax.nn.one_hot(experts_BTk, self.num_experts), axis=2)
        counts_E = jnp.sum(one_hot_BTE * mask_BT[..., None], axis=(0, 1))
        probs_E = jnp.sum(probs_BTE * mask_BT[..., None], axis=(0, 1))
        # FSDP-split expert weights are gathered here (reduce-scattered in the backward),
        # like a dense weight before its matmul.
        weight = lambda p, spec: jax.sharding.reshard(p[...].astype(self.dtype), spec)  # noqa: E731
        gate_EMF = weight(self.gate, s.gate_compute)
        up_EMF = weight(self.up, s.up_compute)
        down_EFM = weight(self.down, s.down_compute)
        biases, bias_specs = (), ()
        if self.gate_bias is not None:
            biases = (
                weight(self.gate_bias, s.gate_bias_compute),
                weight(self.up_bias, s.gate_bias_compute),
                weight(self.down_bias, s.down_bias_compute),
            )
            bias_specs = (s.gate_bias_compute, s.gate_bias_compute, s.down_bias_compute)
        scatter_out = s.ffn_axis is not None and normalize(s.out, 3)[2] == s.ffn_axis
        routing = jax.sharding.PartitionSpec(*tuple(normalize(s.tokens, 3))[:2], None)
        platform = compile_platform()
        compute = jax.shard_map(
            functools.partial(
                _local_moe,
                num_experts=self.num_experts,
                expert_axis=s.expert_axis,
                ffn_axis=s.ffn_axis,
                scatter_out=scatter_out,
                exchange=resolve_exchange(self.exchange, platform),
                capacity_factor=self.capacity_factor,
                packet_rows=packet_rows(platform, x_BTM.shape[-1] * jnp.dtype(self.dtype).itemsize),
                act=self.act,
                matmul=resolve_matmul(self.matmul, platform),
            ),
            in_specs=(
                s.tokens,
                routing,
                routing,
                s.gate_compute,
                s.up_compute,
                s.down_compute,
                bias_specs,
            ),
            # One count of dropped assignments per device holding distinct tokens.
            out_specs=(s.out if scatter_out else s.tokens, _token_devices(s.tokens)),
            # Inside a pipeline's shard_map (manual over `stage`) jax 0.10.2 types this
            # one's residuals as varying over `stage` ahead of its own free axes, which
            # Shardy's verifier refuses ("manual axes must come before free axes"); without
            # the check they carry no such type. Outside one, the check stays on.
            check_vma=not _inside_manual_axes(),
        )
        x_BTM = jax.sharding.reshard(x_BTM.astype(self.dtype), s.tokens)
        experts_BTk = jax.sharding.reshard(experts_BTk, routing)
        weights_BTk = jax.sharding.reshard(weights_BTk, routing)
        y_BTM, dropped_D = compute(
            x_BTM, experts_BTk, weights_BTk, gate_EMF, up_EMF, down_EFM, biases
        )
        B, T, _ = x_BTM.shape
        stats = RouterStats(
            counts=counts_E,
            probs=probs_E,
            tokens=jnp.sum(mask_BT),
            dropped=jnp.sum(dropped_D).astype(jnp.float32),
            assigned=jnp.asarray(B * T * self.k, jnp.float32),
        )
        return jax.sharding.reshard(y_BTM, s.out), stats


def _inside_manual_axes() -> bool:
    """Whether this trace runs inside a shard_map manual over some mesh axis."""
    return bool(jax.sharding.get_abstract_mesh().manual_axes)


def _token_devices(tokens: jax.sharding.PartitionSpec) -> jax.sharding.PartitionSpec:
    """[devices] over every mesh axis that splits the tokens' B or T, in that order."""
    axes = []
    for entry in tuple(normalize(tokens, 3))[:2]:
        axes += [] if entry is None else list(entry if isinstance(entry, tuple) else (entry,))
    return jax.sharding.PartitionSpec(tuple(axes) or None)
