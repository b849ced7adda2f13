"""Named strategies: every layout decision of the project, and nowhere else.

Notation in comments: dims with `/axis` for a sharded dim (`B/data T M/model`). The
collectives named are the ones the layouts imply; XLA inserts them, we only declare.
Stacked layer weights get a leading, never-sharded L dim (`specs.stacked`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from jax.sharding import PartitionSpec as P

from shardings.specs import (
    AttentionSharding,
    BlockSharding,
    EmbeddingSharding,
    LinearSharding,
    LmSharding,
    MlpSharding,
    MoeSharding,
    NormSharding,
)

DATA = "data"  # batch, and the FSDP weight shards
MODEL = "model"  # tensor parallel: heads, FFN width, vocab
EXPERT = "expert"  # expert parallel: MoE experts; the batch is split over it too
# Data parallel across slices / hosts (DCN): only the gradient all-reduce crosses it.
REPLICA = "replica"
# Sequence split for long context: T of every activation, K/V gathered inside attention.
CONTEXT = "context"

# Tensor parallelism stays inside one NVLink/ICI domain: 8 devices on a GPU node.
MAX_MODEL_AXIS = 8
# So does the expert all-to-all (twice per MoE layer, forward).
MAX_EXPERT_AXIS = 8


@dataclasses.dataclass(frozen=True)
class Strategy:
    name: str
    axes: tuple[str, ...]
    description: str
    _build: Callable[[], LmSharding]
    _default_model_axis: Callable[[int, int], int] | None = None

    def lm_sharding(self) -> LmSharding:
        return self._build()

    def batch_spec(self) -> P:
        """Layout of [B, T] inputs (tokens, segment ids, positions)."""
        return self.lm_sharding().tokens

    def default_mesh_shape(
        self,
        num_devices: int,
        num_kv_heads: int | None = None,
        num_slices: int = 1,
        num_experts: int | None = None,
    ) -> tuple:
        """Documented rule: one-axis strategies put every device on `data`.

        Two-axis strategies put on `model` the largest divisor of the device count that
        also divides the kv head count (heads are split on `model`, so it must), is at
        most 8, and, for `fsdp_tp`, at most sqrt(devices) so FSDP keeps the larger share;
        `data` takes the rest. `replica` (hsdp, hsdp_tp) is the number of slices (TPU
        slices, else processes; 1 on one host) and the rule above applies within a slice.
        `context` (fsdp_cp) is the largest divisor of the device count <= sqrt(devices).
        `expert` (fsdp_ep) is the largest divisor of the device count that divides the expert
        count and is at most 8 (1 for a dense model).
        """
        sizes = {}
        if REPLICA in self.axes:
            sizes[REPLICA] = num_slices
        inner = num_devices // sizes.get(REPLICA, 1)
        if MODEL in self.axes:
            sizes[MODEL] = self._default_model_axis(inner, num_kv_heads or MAX_MODEL_AXIS)
            inner //= sizes[MODEL]
        if EXPERT in self.axes:
            sizes[EXPERT] = _ep_expert_axis(inner, num_experts or 1)
            inner //= sizes[EXPERT]
        if CONTEXT in self.axes:
            sizes[CONTEXT] = _largest_model_axis(inner, inner, math.isqrt(inner))
            inner //= sizes[CONTEXT]
        sizes[DATA] = inner
        return tuple(sizes[a] for a in self.axes)

    def make_mesh(self, shape=None, devices=None, config=None):
        """An explicit mesh over `devices` (default: all). Without `shape`, the default rule
        above, taking the kv head count from `config` when given."""
        from shardings.mesh import make_mesh

        kv_heads = getattr(config, "num_kv_heads", None)
        experts = getattr(config, "num_experts", None)
        return make_mesh(
            self, shape=shape, devices=devices, num_kv_heads=kv_heads, num_experts=experts
        )


def _linear(weight: P, out: P, feature_dims: int = 1) -> LinearSharding:
    # A bias over the output features (the trailing `feature_dims` dims: [N, D], [F] or
    # [M]) carries the output's layout of those dims, else broadcasting re-imposes the
    # bias's own layout on the sum.
    return LinearSharding(weight=weight, out=out, bias=P(*tuple(out)[-feature_dims:]))


def _norm(out: P) -> NormSharding:
    # Norm scales are [M] (or [D]): tiny, so always replicated; sharding them saves nothing
    # and would cost a gather on every use.
    return NormSharding(weight=P(None), out=out)


Axes = str | tuple[str, ...] | None


def _lm(
    *,
    batch: Axes,
    fsdp: Axes,
    tp: str | None,
    residual_tp: bool,
    seq: str | None = None,
    expert: str | None = None,
) -> LmSharding:
    """The one template every strategy fills.

    batch: axis (or axes) of the batch dim; fsdp: axis (or axes) the weights are split on
    besides the tensor parallel split; tp: axis of heads / FFN width / vocab; residual_tp:
    whether the residual stream between blocks is split on M over `tp` (seqax-style, saves
    activation memory and turns the post-contraction all-reduce into a reduce-scatter);
    seq: axis of T in every activation (context parallelism), or None; expert: axis the MoE
    experts are split over (tokens then travel to their experts by all-to-all).
    """
    tokens = P(batch, seq)
    residual = P(batch, seq, tp if residual_tp else None)
    # Inputs to every matmul are gathered on M: `B/batch T M`. With a split residual this
    # is the all-gather over `model` after each norm (seqax's layout); otherwise a no-op.
    gathered = P(batch, seq, None)
    heads = P(batch, seq, tp, None)  # [B, T, N|K, D]: heads split over tp
    ffn = P(batch, seq, tp)  # [B, T, F]

    # Kernels reading the residual, [M, *]: FSDP splits M (the contracting dim), so the
    # weight is all-gathered over `fsdp` just before the matmul and freed after; tp splits
    # the output features, so no communication inside the matmul.
    w_in_heads = P(fsdp, tp, None)  # [M, N|K, D]
    w_in_ffn = P(fsdp, tp)  # [M, F]
    # Kernels writing the residual, [*, M]: tp splits the contracting dim, so each device
    # holds a partial sum that XLA reduces -- a reduce-scatter over `model` into a split
    # residual, or an all-reduce into a replicated one. FSDP splits M (gathered first).
    w_out_heads = P(tp, None, fsdp)  # [N, D, M]
    w_out_ffn = P(tp, fsdp)  # [F, M]

    q = _linear(w_in_heads, heads, feature_dims=2)
    kv = _linear(w_in_heads, heads, feature_dims=2)
    head_norm = _norm(heads)
    attention = AttentionSharding(
        q=q,
        k=kv,
        v=kv,
        o=_linear(w_out_heads, residual),
        q_norm=head_norm,
        k_norm=head_norm,
        # Decoding appends one token at a time: the cache's S is never split.
        kv_cache=P(batch, None, tp, None),
    )
    mlp = MlpSharding(
        gate=_linear(w_in_ffn, ffn),
        up=_linear(w_in_ffn, ffn),
        down=_linear(w_out_ffn, residual),
    )
    # MoE. Router [M, E]: tiny (E columns), so only FSDP-split; its logits stay `B/batch T E`
    # so routing is local to each token's device. Experts [E, M, F] / [E, F, M]: E over the
    # expert axis (each device keeps E/expert whole experts: no communication inside an
    # expert's matmul), F over tp like the dense MLP, M over fsdp and gathered for the compute.
    moe = MoeSharding(
        router=LinearSharding(weight=P(fsdp, None), out=P(batch, None, None)),
        gate=P(expert, fsdp, tp),
        up=P(expert, fsdp, tp),
        down=P(expert, tp, fsdp),
        gate_compute=P(expert, None, tp),
        up_compute=P(expert, None, tp),
        down_compute=P(expert, tp, None),
        tokens=gathered,
        dispatched=P(expert, None, None),
        # With a split residual, the partial sums over tp are reduce-scattered into it.
        out=residual,
        expert_axis=expert,
        ffn_axis=tp,
    )
    block = BlockSharding(
        residual=residual,
        attn_norm=_norm(gathered),
        attention=attention,
        post_attn_norm=_norm(residual),
        mlp_norm=_norm(gathered),
        mlp=mlp,
        post_mlp_norm=_norm(residual),
        moe=moe,
    )
    # Embedding [V, M]: split on M, never on V, so the row gather needs no communication;
    # over tp the rows land already split like the residual (`M/model`), over fsdp they are
    # gathered on M (one all-gather of the table per step).
    embed = EmbeddingSharding(table=P(None, tp or fsdp), out=residual)
    position_embed = EmbeddingSharding(table=P(None, tp or fsdp), out=residual)
    # LM head [M, V]: vocab split over tp keeps logits `V/model` (the loss handles a split
    # vocab); M split over fsdp is gathered before the matmul.
    lm_head = _linear(P(fsdp, tp), P(batch, seq, tp))
    return LmSharding(
        tokens=tokens,
        embed=embed,
        position_embed=position_embed,
        block=block,
        final_norm=_norm(gathered),
        lm_head=lm_head,
    )


def _largest_model_axis(num_devices: int, num_kv_heads: int, cap: int) -> int:
    best = 1
    for d in range(1, min(num_devices, cap) + 1):
        if num_devices % d == 0 and num_kv_heads % d == 0:
            best = d
    return best


def _tp_model_axis(num_devices: int, num_kv_heads: int) -> int:
    return _largest_model_axis(num_devices, num_kv_heads, MAX_MODEL_AXIS)


def _fsdp_tp_model_axis(num_devices: int, num_kv_heads: int) -> int:
    cap = min(MAX_MODEL_AXIS, math.isqrt(num_devices))
    return _largest_model_axis(num_devices, num_kv_heads, cap)


def _ep_expert_axis(num_devices: int, num_experts: int) -> int:
    return _largest_model_axis(num_devices, num_experts, MAX_EXPERT_AXIS)


STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for s in (
        Strategy(
            name="dp",
            axes=(DATA,),
            description="data parallel: batch split over `data`, weights replicated; "
            "gradients all-reduced over `data`",
            _build=lambda: _lm(batch=DATA, fsdp=None, tp=None, residual_tp=False),
        ),
        Strategy(
            name="fsdp",
            axes=(DATA,),
            description="fully sharded data parallel (ZeRO-3): batch and every matrix split "
            "over `data`; weights all-gathered per matmul, gradients reduce-scattered",
            _build=lambda: _lm(batch=DATA, fsdp=DATA, tp=None, residual_tp=False),
        ),
        Strategy(
            name="tp",
            axes=(DATA, MODEL),
            description="Megatron tensor parallel over `model` (heads, FFN width, vocab), "
            "plain data parallel over `data`; residual replicated over `model`",
            _build=lambda: _lm(batch=DATA, fsdp=None, tp=MODEL, residual_tp=False),
            _default_model_axis=_tp_model_axis,
        ),
        Strategy(
            name="fsdp_tp",
            axes=(DATA, MODEL),
            description="FSDP over `data` and tensor parallel over `model`; the residual "
            "stream is split on M over `model` between blocks (seqax layout)",
            _build=lambda: _lm(batch=DATA, fsdp=DATA, tp=MODEL, residual_tp=True),
            _default_model_axis=_fsdp_tp_model_axis,
        ),
        # Hybrid sharded data parallel: the mesh puts `replica` across slices (DCN) and
        # `data` / `model` inside one (shardings/hybrid.py). Weights are split over `data`
        # only, so the per-matmul all-gathers and the gradient reduce-scatters stay on the
        # fast links; the one collective over `replica` is the all-reduce of the already
        # `data`-sharded gradients. The batch is split over both: `B/(replica,data) T`.
        Strategy(
            name="hsdp",
            axes=(REPLICA, DATA),
            description="hybrid sharded data parallel: FSDP over `data` inside a slice, "
            "replicated over `replica` across slices; batch over both",
            _build=lambda: _lm(batch=(REPLICA, DATA), fsdp=DATA, tp=None, residual_tp=False),
        ),
        Strategy(
            name="hsdp_tp",
            axes=(REPLICA, DATA, MODEL),
            description="fsdp_tp inside a slice (`data`, `model`), replicated over `replica` "
            "across slices; batch over `replica` and `data`",
            _build=lambda: _lm(batch=(REPLICA, DATA), fsdp=DATA, tp=MODEL, residual_tp=True),
            _default_model_axis=_fsdp_tp_model_axis,
        ),
        Strategy(
            name="fsdp_ep",
            axes=(DATA, EXPERT),
            description="expert parallel: MoE experts split over `expert`, tokens sent to "
            "their experts and back by all-to-all over `expert`; the batch split over "
            "`data` x `expert`, every other weight FSDP over `data`",
            # The batch takes both axes so no device repeats another's attention work; the
            # dense weights are FSDP over `data` only (replicated over `expert`).
            _build=lambda: _lm(
                batch=(DATA, EXPERT), fsdp=DATA, tp=None, residual_tp=False, expert=EXPERT
            ),
        ),
    )
}


def get_strategy(name: str) -> Strategy:
    try:
        return STRATEGIES[name]
    except KeyError:
        valid = ", ".join(sorted(STRATEGIES))
        raise ValueError(f"unknown sharding strategy {name!r}; valid strategies: {valid}") from None
