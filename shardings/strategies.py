"""Named strategies: every layout decision of the project, and nowhere else.

A strategy is a table of rules from logical dims (the names below) to mesh axes; `_lm` turns
the table into the typed dataclasses of shardings/specs.py, so the modules never see it. A
logical dim the table does not name is replicated. Adding a strategy is a new table; adding a
kind of split (experts, a context axis) is a new logical dim here and its use in `_lm`.

Notation in comments: dims with `/axis` for a sharded dim (`B/data T M/model`). The
collectives named are the ones a rule implies; XLA inserts them, we only declare.
Stacked layer weights get a leading L dim, laid out by the `layers` rule (over `stage` in the
pipeline strategies, else whole).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping

from jax.sharding import PartitionSpec as P

from nnx_zoo.errors import UsageError
from shardings.hybrid import REPLICA
from shardings.mesh import make_mesh
from shardings.specs import (
    AttentionSharding,
    BlockSharding,
    EmbeddingSharding,
    LinearSharding,
    LmSharding,
    MlaSharding,
    MlpSharding,
    MoeSharding,
    MtpSharding,
    NormSharding,
    axes_of,
)

DATA = "data"  # batch, and the FSDP weight shards
MODEL = "model"  # tensor parallel: heads, FFN width, vocab
# REPLICA (shardings.hybrid): data parallel across slices / hosts (DCN); only the gradient
# all-reduce crosses it.
# Sequence split for long context: T of every activation, K/V gathered inside attention.
CONTEXT = "context"
# Expert parallel: MoE experts split, tokens sent to their experts by all-to-all over it.
EXPERT = "expert"
# Pipeline parallel: the layer stack split into stages; activations collective-permuted
# from stage to stage (zoo/layers/pipeline.py). Outermost in the mesh: across hosts.
STAGE = "stage"

# The logical dims a rule may name, each with the config field that gives its size (None:
# no single field), which the default mesh rule must divide.
LOGICAL_DIMS: dict[str, str | None] = {
    "batch": None,  # B of every input and activation
    "seq": None,  # T of the inputs and of the activations inside a block
    "residual_seq": None,  # T of the residual stream between blocks (a context split names both)
    "residual": "hidden_dim",  # M of the residual stream between blocks
    "embed_fsdp": "hidden_dim",  # M of every weight matrix (the FSDP split)
    "table_embed": "hidden_dim",  # M of the embedding tables [V, M] and [T_max, M]
    "heads": "num_heads",  # N of the query projection and query heads
    "kv_heads": "num_kv_heads",  # K of the key/value projections, heads and cache
    "ffn": "ffn_dim",  # F of the MLP
    # V of the LM head and the logits: no limit on the axis, since a vocab that does not
    # divide is padded until it does (zoo.plan.fit_vocab).
    "vocab": None,
    "expert": "num_experts",  # E of the stacked MoE expert weights
    "expert_ffn": "moe_ffn_dim",  # F of one MoE expert
    # M of the stacked MoE expert weights (their FSDP split); a strategy without this rule
    # splits it as `embed_fsdp`. Expert parallelism needs both: its `expert` axis splits E of
    # the experts and, as a further FSDP axis, M of every other weight (`FSDP_EP`).
    "expert_embed": "hidden_dim",
    "layers": "stacked_layers",  # L of the stacked layer weights (the pipeline's stages)
}

EXPERT_DIM_FIELD = LOGICAL_DIMS["expert"]

Axes = str | tuple[str, ...] | None

# Tensor parallelism stays inside one NVLink/ICI domain: 8 devices on a GPU node.
MAX_MODEL_AXIS = 8


@dataclasses.dataclass(frozen=True, eq=False)
class Strategy:
    """A named rule table over the mesh axes `axes` (in mesh order). For the default mesh,
    each axis other than `data` and `replica` is at most `axis_caps[axis](devices per
    slice)`."""

    name: str
    axes: tuple[str, ...]
    rules: Mapping[str, Axes]
    axis_caps: Mapping[str, Callable[[int], int]] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        for dim, axes in self.rules.items():
            if dim not in LOGICAL_DIMS:
                raise ValueError(
                    f"strategy {self.name!r}: unknown logical dim {dim!r}; "
                    f"valid: {', '.join(LOGICAL_DIMS)}"
                )
            for axis in _as_tuple(axes):
                if axis not in self.axes:
                    raise ValueError(
                        f"strategy {self.name!r}: rule {dim!r} -> {axis!r} names an axis "
                        f"outside its mesh axes {self.axes}"
                    )
        stage = _as_tuple(self.rules.get("layers"))
        if stage and _as_tuple(self.rules.get("batch"))[-1:] != stage:
            # The pipeline takes each stage's rows in and hands them back (zoo/layers/
            # pipeline.py): outside the layer stack B is split over `stage` too, minor-most.
            raise ValueError(
                f"strategy {self.name!r}: a pipeline's rule 'layers' -> {stage[0]!r} needs "
                f"{stage[0]!r} as the last axis of rule 'batch'"
            )

    def spec(self, *dims: str | None) -> P:
        """The layout of an array whose dims are these logical dims (None: never split)."""
        return P(*(self.rules.get(d) if d is not None else None for d in dims))

    def lm_sharding(self) -> LmSharding:
        return _lm(self)

    def batch_spec(self) -> P:
        """Layout of [B, T] inputs (tokens, segment ids, positions)."""
        return self.lm_sharding().tokens

    def default_mesh_shape(self, num_devices: int, config=None, num_slices: int = 1) -> tuple:
        """Documented rule. `replica` is the number of slices (TPU slices, else processes;
        1 on one host); the other axes share the devices of one slice. In `axes` order,
        every axis but `data` gets the largest size that divides the devices left and every
        `config` size the axis splits (the config fields of the dims its rules name: heads,
        kv heads, FFN width, M; not the vocab, which is padded to fit), at most its cap;
        `data` takes the rest. Without a config those sizes are unknown, so such an axis
        gets 1: the one mesh every model accepts (pass `config` to get a split). An axis that
        splits the experts is 1 for a model without experts (it would only repeat fsdp).
        """
        sizes = {}
        if REPLICA in self.axes:
            sizes[REPLICA] = num_slices
        left = num_devices // sizes.get(REPLICA, 1)
        per_slice = left
        for axis in self.axes:
            if axis in (DATA, REPLICA):
                continue
            fields = [
                LOGICAL_DIMS[dim]
                for dim, axes in self.rules.items()
                if axis in _as_tuple(axes) and LOGICAL_DIMS[dim] is not None
            ]
            if fields and config is None:
                sizes[axis] = 1
            else:
                cap = self.axis_caps.get(axis, lambda n: n)(per_slice)
                # A size of 0 is a dim the model lacks (a dense model's experts): it splits
                # nothing, so an axis that splits only such dims stays 1.
                dims = [getattr(config, f) for f in fields]
                present = [d for d in dims if d]
                # An axis that splits the experts is for them: a model without any (a dense
                # model under fsdp_ep) leaves it 1, whatever else it would split as FSDP.
                expertless = EXPERT_DIM_FIELD in fields and not getattr(config, EXPERT_DIM_FIELD)
                split = (present or not dims) and not expertless
                sizes[axis] = _largest_divisor(left, present, cap) if split else 1
            left //= sizes[axis]
        sizes[DATA] = left
        return tuple(sizes[a] for a in self.axes)

    def make_mesh(self, shape=None, devices=None, config=None):
        """An explicit mesh over `devices` (default: all). Without `shape`, the default rule
        above, for `config` when given."""
        return make_mesh(self, shape=shape, devices=devices, config=config)


def _as_tuple(axes: Axes) -> tuple[str, ...]:
    return axes_of(axes)


def _largest_divisor(num_devices: int, dims: list[int], cap: int) -> int:
    best = 1
    for d in range(1, min(num_devices, cap) + 1):
        if num_devices % d == 0 and all(size % d == 0 for size in dims):
            best = d
    return best


def _linear(weight: P, out: P, feature_dims: int = 1) -> LinearSharding:
    # A bias over the output features (the trailing `feature_dims` dims: [N, D], [F] or
    # [M]) carries the output's layout of those dims, else broadcasting re-imposes the
    # bias's own layout on the sum.
    return LinearSharding(weight=weight, out=out, bias=P(*tuple(out)[-feature_dims:]))


def _norm(out: P) -> NormSharding:
    # Norm scales are [M] (or [D]): tiny, so always replicated; sharding them saves nothing
    # and would cost a gather on every use.
    return NormSharding(weight=P(None), out=out)


def _lm(s: Strategy) -> LmSharding:
    """The typed layouts of a whole model, written in logical dims; `s.spec` applies the
    strategy's table. What no table may change (D, the vocab dim of the embedding table,
    a matmul input's M) is a plain None, with the reason."""
    # Outside the layer stack: the inputs, the embeddings, the final norm, the LM head and
    # the loss. Under a pipeline their rows are split over `stage` too (the `batch` rule),
    # so each stage embeds, and runs the head and the loss on, its own rows.
    outer = s
    tokens = outer.spec("batch", "seq")
    # Inside a pipeline's stages (the blocks) B is split over the batch axes but `stage`:
    # the pipeline is manual over `stage`, and streams every micro-batch through every stage.
    s = _inside_stages(outer)
    block = _block(s)
    # Layers a model runs before the schedule (DeepSeek-V3's dense first layers) see the
    # rows as the embedding does, split over `stage` too.
    before = _block(_before_stages(outer)) if outer.rules.get("layers") else None
    # Embedding tables [V, M] / [T_max, M]: never split on V, so the row gather needs no
    # communication; their M follows `table_embed`.
    table = s.spec(None, "table_embed")
    outer_residual = outer.spec("batch", "residual_seq", "residual")
    # LM head [M, V] -> logits [B, T, V]: the loss handles a split vocab.
    return LmSharding(
        # A split T runs in balanced chunk order inside the model, so that causal attention
        # gives every device the same work (zoo/layers/attention/context_parallel.py).
        seq_order="balanced" if s.rules.get("seq") else "natural",
        stage_axis=outer.rules.get("layers"),
        tokens=tokens,
        embed=EmbeddingSharding(table=table, out=outer_residual),
        position_embed=EmbeddingSharding(table=table, out=outer_residual),
        block=block,
        before_stack=before,
        final_norm=_norm(outer.spec("batch", "seq", None)),
        lm_head=_linear(s.spec("embed_fsdp", "vocab"), outer.spec("batch", "seq", "vocab")),
        # Multi-token prediction (DeepSeek-V3): its inputs normed whole on M, as a block's
        # are; eh_proj [2M, M] like the latents' down-projections (only its input dim split,
        # FSDP, gathered per matmul) writing the residual; its head norm the final norm's.
        mtp=MtpSharding(
            enorm=_norm(s.spec("batch", "seq", None)),
            hnorm=_norm(s.spec("batch", "seq", None)),
            eh_proj=_linear(
                s.spec("embed_fsdp", None), s.spec("batch", "residual_seq", "residual")
            ),
            head_norm=_norm(outer.spec("batch", "seq", None)),
        ),
    )


def _block(s: Strategy) -> BlockSharding:
    """The layouts of one layer (every block of the stack), from `s`'s rules as the blocks
    see them."""
    residual = s.spec("batch", "residual_seq", "residual")
    # Inputs to every matmul are whole on M, because the weights' M is split only for
    # storage (FSDP) and gathered: `B T M`. With a split residual this is the all-gather
    # after each norm (seqax's layout); otherwise a no-op.
    gathered = s.spec("batch", "seq", None)
    q_heads = s.spec("batch", "seq", "heads", None)  # [B, T, N, D]
    kv_heads = s.spec("batch", "seq", "kv_heads", None)  # [B, T, K, D]
    ffn = s.spec("batch", "seq", "ffn")  # [B, T, F]

    # Kernels reading the residual, [M, *]: FSDP splits M (the contracting dim), so the
    # weight is all-gathered just before the matmul and freed after; heads / F split the
    # output features, so no communication inside the matmul.
    w_q = s.spec("embed_fsdp", "heads", None)  # [M, N, D]
    w_kv = s.spec("embed_fsdp", "kv_heads", None)  # [M, K, D]
    w_in_ffn = s.spec("embed_fsdp", "ffn")  # [M, F]
    # Kernels writing the residual, [*, M]: a split N / F is the contracting dim, so each
    # device holds a partial sum that XLA reduces -- a reduce-scatter into a split residual,
    # or an all-reduce into a replicated one. FSDP splits M (gathered first).
    w_o = s.spec("heads", None, "embed_fsdp")  # [N, D, M]
    w_out_ffn = s.spec("ffn", "embed_fsdp")  # [F, M]

    attention = AttentionSharding(
        q=_linear(w_q, q_heads, feature_dims=2),
        k=_linear(w_kv, kv_heads, feature_dims=2),
        v=_linear(w_kv, kv_heads, feature_dims=2),
        o=_linear(w_o, residual),
        q_norm=_norm(q_heads),
        k_norm=_norm(kv_heads),
        kv_cache=s.spec("batch", None, "kv_heads", None),  # [B, S, K, D]
        # Sinks [N]: N floats, replicated (a sharded [N] would re-impose its split on the
        # head-split logits it is added to); each device reads its heads' slice locally.
        sinks=P(None),
    )
    mlp = MlpSharding(
        gate=_linear(w_in_ffn, ffn),
        up=_linear(w_in_ffn, ffn),
        down=_linear(w_out_ffn, residual),
    )
    # MoE. Router [M, E]: tiny (E columns), so only FSDP-split; its logits stay `B T E` with
    # the batch's split, so routing is local to each token's device. Experts [E, M, F] /
    # [E, F, M]: E over `expert` (each device keeps whole experts: no communication inside
    # an expert's matmul; tokens travel instead), F as the dense MLP's, M over FSDP and
    # gathered for the compute like any FSDP weight.
    expert_axis, expert_ffn_axis = s.rules.get("expert"), s.rules.get("expert_ffn")
    expert_embed = "expert_embed" if "expert_embed" in s.rules else "embed_fsdp"
    moe = MoeSharding(
        router=_linear(s.spec("embed_fsdp", None), s.spec("batch", "seq", None)),
        gate=s.spec("expert", expert_embed, "expert_ffn"),
        up=s.spec("expert", expert_embed, "expert_ffn"),
        down=s.spec("expert", "expert_ffn", expert_embed),
        gate_compute=s.spec("expert", None, "expert_ffn"),
        up_compute=s.spec("expert", None, "expert_ffn"),
        down_compute=s.spec("expert", "expert_ffn", None),
        tokens=gathered,
        dispatched=s.spec("expert", None, None),
        # A split F leaves partial sums of `down`: reduce-scattered into a split residual,
        # else all-reduced, as the dense MLP's are.
        out=residual,
        expert_axis=expert_axis,
        ffn_axis=expert_ffn_axis,
        # Expert biases: E and F split as their weights' (each device adds the biases of its
        # own experts and F slice), M whole (a few floats per expert, not worth an FSDP
        # split); the router's bias [E] is its output's, `_linear`'s rule.
        gate_bias=s.spec("expert", "expert_ffn"),
        down_bias=s.spec("expert", None),
        gate_bias_compute=s.spec("expert", "expert_ffn"),
        down_bias_compute=s.spec("expert", None),
    )
    return BlockSharding(
        residual=residual,
        attn_norm=_norm(gathered),
        attention=attention,
        post_attn_norm=_norm(residual),
        mlp_norm=_norm(gathered),
        mlp=mlp,
        post_mlp_norm=_norm(residual),
        moe=moe,
        mla=_mla(s, q_heads, residual),
    )


def _mla(s: Strategy, q_heads: P, residual: P) -> MlaSharding:
    """Multi-head latent attention's layouts (DeepSeek-V3), in the same logical dims. The
    latents ([B, T, Q], [B, T, C + r]) are narrow (1536 and 576 of DeepSeek-V3's 7168), so
    their down-projections split only M (FSDP, gathered per matmul) and every `model` device
    computes them whole; the up-projections [Q or C, N, D] split their heads as q does, so
    the heads' keys and values are expanded where they are used, without communication. The
    latent's width is an input dim like M: stored split over the FSDP axes, gathered."""
    latent = s.spec("batch", "seq", None)
    return MlaSharding(
        q=_linear(s.spec("embed_fsdp", "heads", None), q_heads, feature_dims=2),
        q_a=_linear(s.spec("embed_fsdp", None), latent),
        q_a_norm=_norm(latent),
        q_b=_linear(s.spec("embed_fsdp", "heads", None), q_heads, feature_dims=2),
        kv_a=_linear(s.spec("embed_fsdp", None), latent),
        kv_a_norm=_norm(latent),
        kv_b=_linear(s.spec("embed_fsdp", "heads", None), q_heads, feature_dims=2),
        o=_linear(s.spec("heads", None, "embed_fsdp"), residual),
        heads=q_heads,
        # One latent per token, shared by every head: split only over the batch.
        cache=s.spec("batch", None, None, None),
    )


def _inside_stages(s: Strategy) -> Strategy:
    """`s` as the blocks of a pipeline see them: `batch` without the stage axis, and no
    `layers` rule (the stacked weights' split is `LmSharding.stage_axis`). `s` itself when
    it has no `layers` rule."""
    stage = s.rules.get("layers")
    if stage is None:
        return s
    batch = tuple(a for a in _as_tuple(s.rules.get("batch")) if a not in _as_tuple(stage))
    rules = {k: v for k, v in s.rules.items() if k != "layers"}
    rules["batch"] = batch[0] if len(batch) == 1 else (batch or None)
    return dataclasses.replace(s, rules=rules)


def _before_stages(s: Strategy) -> Strategy:
    """`s` as layers run before a pipeline's schedule see it: no `layers` rule; the rows
    split over the batch axes and `stage` (the embedding's layout), and so, the weights too
    (their FSDP axes plus `stage`): every device holds other rows there, so for these layers
    `stage` is one more data axis, and their weights are not whole on every stage."""
    stage = _as_tuple(s.rules["layers"])
    rules = {k: v for k, v in s.rules.items() if k != "layers"}
    for dim in ("embed_fsdp", "expert_embed"):
        if dim in rules:
            axes = _as_tuple(rules[dim]) + stage
            rules[dim] = axes[0] if len(axes) == 1 else axes
    return dataclasses.replace(s, rules=rules)


def _at_most_node(num_devices: int) -> int:
    return MAX_MODEL_AXIS


def _at_most_node_and_sqrt(num_devices: int) -> int:
    # FSDP keeps the larger share of the devices: its memory saving grows with its axis.
    return min(MAX_MODEL_AXIS, math.isqrt(num_devices))


# -- the strategies ---------------------------------------------------------------------------

DP = Strategy(
    name="dp",
    axes=(DATA,),
    rules={
        # Each device takes B/data rows and a full copy of the weights; the gradients are
        # all-reduced over `data` once per step.
        "batch": DATA,
    },
)

FSDP = Strategy(
    name="fsdp",
    axes=(DATA,),
    rules={
        "batch": DATA,  # as dp: gradients reduce-scattered over `data` onto the shards
        # ZeRO-3: every matrix is stored split on M over `data` and all-gathered just
        # before its matmul (freed after).
        "embed_fsdp": DATA,
        # The embedding table is split on M too; its rows are gathered on M after the
        # lookup (one all-gather of the looked-up rows per step).
        "table_embed": DATA,
    },
)

TP = Strategy(
    name="tp",
    axes=(DATA, MODEL),
    axis_caps={MODEL: _at_most_node},
    rules={
        "batch": DATA,  # plain data parallel across `data`
        # Megatron: q/k/v and gate/up split their output features over `model` (no
        # communication); o and down contract over the split dim, so their output is
        # all-reduced over `model` into the replicated residual.
        "heads": MODEL,
        "kv_heads": MODEL,
        "ffn": MODEL,
        "expert_ffn": MODEL,  # each expert's F, as the dense MLP's
        # Logits stay `V/model`; the loss reduces over the split vocab (an all-reduce of
        # the log-sum-exp terms).
        "vocab": MODEL,
        # The embedding rows land split on M over `model`, then are gathered into the
        # replicated residual (an all-gather over `model`).
        "table_embed": MODEL,
    },
)

FSDP_TP = Strategy(
    name="fsdp_tp",
    axes=(DATA, MODEL),
    axis_caps={MODEL: _at_most_node_and_sqrt},
    rules={
        "batch": DATA,
        "embed_fsdp": DATA,  # as fsdp: matrices gathered over `data` per matmul
        "heads": MODEL,  # as tp
        "kv_heads": MODEL,
        "ffn": MODEL,
        "expert_ffn": MODEL,  # each expert's F, as the dense MLP's
        "vocab": MODEL,
        # seqax: the residual between blocks is split on M over `model`, so o and down
        # reduce-scatter into it (instead of all-reducing) and each norm's output is
        # all-gathered over `model` before the next matmul; activation memory / model.
        "residual": MODEL,
        # The embedding rows land already split like the residual: no communication.
        "table_embed": MODEL,
    },
)

# Megatron sequence parallelism (Korthikanti et al. 2022) on top of tensor parallelism: between
# the tensor-parallel regions the residual stream is split on T over `model` (`B/data T/model
# M`), so the norms, the residual adds and (under remat) the saved residuals are 1/model per
# device, each computed once instead of on every model device's copy. Each norm's output is
# all-gathered on T over `model` into attention / the MLP (`B/data T M`), and o and down, which
# contract over the split heads / F, reduce-scatter their partial sums on T back into the
# residual: an all-gather + reduce-scatter pair per sub-block, the volume of one all-reduce.
# Weights are laid out exactly as the tensor-parallel strategy's, so checkpoints move between
# the two as they are.
SEQUENCE_PARALLEL = {
    # T of the residual stream between blocks: all-gathered over `model` after each norm,
    # reduce-scattered over `model` by o and down.
    "residual_seq": MODEL,
}

TP_SP = Strategy(
    name="tp_sp",
    axes=(DATA, MODEL),
    axis_caps=TP.axis_caps,
    # tp's table (the embedding rows land split on M over `model`, then one all-to-all over
    # `model` turns them into the T-split residual) with the residual split on T.
    rules={**TP.rules, **SEQUENCE_PARALLEL},
)

FSDP_TP_SP = Strategy(
    name="fsdp_tp_sp",
    axes=(DATA, MODEL),
    axis_caps=FSDP_TP.axis_caps,
    # fsdp_tp's table with the residual split on T instead of M (`model` cannot split both);
    # the embedding table stays `V M/model`, its looked-up rows all-to-all'd over `model`
    # into `B/data T/model M`.
    rules={**{k: v for k, v in FSDP_TP.rules.items() if k != "residual"}, **SEQUENCE_PARALLEL},
)

# Hybrid sharded data parallel: the mesh puts `replica` across slices (DCN) and `data` /
# `model` inside one (shardings/hybrid.py). Weights are split over `data` only, so the
# per-matmul all-gathers and the gradient reduce-scatters stay on the fast links.
HSDP = Strategy(
    name="hsdp",
    axes=(REPLICA, DATA),
    # As fsdp inside a slice; the batch is split over both axes, so the one collective over
    # `replica` is the all-reduce of the already `data`-sharded gradients.
    rules={**FSDP.rules, "batch": (REPLICA, DATA)},
)

HSDP_TP = Strategy(
    name="hsdp_tp",
    axes=(REPLICA, DATA, MODEL),
    axis_caps=FSDP_TP.axis_caps,
    rules={**FSDP_TP.rules, "batch": (REPLICA, DATA)},  # as fsdp_tp inside a slice
)

# Context parallelism: T of every activation split over `context` (tokens, residual, MLP
# hidden, logits: `B/data T/context ...`); attention all-gathers K/V over `context` and, in the
# backward pass, reduce-scatters their gradients. The mesh puts `context` inside `data`, on
# the faster links, since its all-gathers come every layer.
FSDP_CP = Strategy(
    name="fsdp_cp",
    axes=(DATA, CONTEXT),
    axis_caps={CONTEXT: math.isqrt},
    rules={
        "batch": DATA,
        "seq": CONTEXT,
        "residual_seq": CONTEXT,
        # The context devices hold different tokens of the same rows, so for the weights
        # they are data parallel: FSDP over `data` and `context` together (the gradients
        # must be summed over both anyway, so they are reduce-scattered over both).
        "embed_fsdp": (DATA, CONTEXT),
        # The embedding table only over `data`: looked-up rows `B/data T/context M` come
        # from a table split on M over `data` by one all-to-all over `data`; split over
        # `context` too, XLA finds no such move and replicates the rows (and, backward,
        # the table's gradient) on every device.
        "table_embed": DATA,
    },
)

FSDP_TP_CP = Strategy(
    name="fsdp_tp_cp",
    axes=(DATA, CONTEXT, MODEL),
    axis_caps={CONTEXT: math.isqrt, MODEL: _at_most_node_and_sqrt},
    rules={
        "batch": DATA,
        "seq": CONTEXT,  # as fsdp_cp
        "residual_seq": CONTEXT,
        "embed_fsdp": (DATA, CONTEXT),
        "heads": MODEL,  # as fsdp_tp: heads, FFN and vocab over `model`
        "kv_heads": MODEL,
        "ffn": MODEL,
        "expert_ffn": MODEL,  # each expert's F, as the dense MLP's
        "vocab": MODEL,
        "residual": MODEL,  # residual `B/data T/context M/model`
        "table_embed": MODEL,
    },
)

# Expert parallelism for MoE models (as MaxText / torchtitan shard experts). The batch is
# split over `data` and `expert` alike, so no device repeats another's attention work, and
# the dense weights (attention, router, embeddings, head) are FSDP over both, as fsdp's over
# every device (MaxText's and DeepSpeed-MoE's expert axis doubles as a data axis for the
# non-expert parameters): kept whole over `expert` they would sit whole on every device of a
# data 1 x expert 8 mesh. A dense model runs as fsdp over all the devices.
FSDP_EP = Strategy(
    name="fsdp_ep",
    axes=(DATA, EXPERT),
    axis_caps={EXPERT: _at_most_node},  # two all-to-alls per MoE layer: keep them on ICI/NVLink
    rules={
        "batch": (DATA, EXPERT),
        "embed_fsdp": (DATA, EXPERT),  # gathered per matmul, gradients reduce-scattered
        "table_embed": (DATA, EXPERT),
        # Each device holds E/expert whole experts, their M FSDP over `data`; after routing,
        # each token's hidden state goes to the device of each chosen expert and back
        # (all-to-all over `expert`).
        "expert": EXPERT,
        "expert_embed": DATA,
    },
)

# Expert parallelism with tensor parallelism inside (MaxText's EP x TP): experts over
# `expert` as fsdp_ep; each expert's F, the attention heads, the MLP and the vocab over `model`
# as fsdp_tp, for a dense part too large for FSDP alone; the rest FSDP over `data`. The
# `model` devices of one expert column hold the same tokens and each exchange them with their
# own column (all-to-all over `expert`), then reduce-scatter the experts' partial sums of
# `down` over `model` into the split residual, as the dense MLP does.
FSDP_TP_EP = Strategy(
    name="fsdp_tp_ep",
    axes=(DATA, EXPERT, MODEL),
    axis_caps={EXPERT: _at_most_node, MODEL: _at_most_node_and_sqrt},
    rules={**FSDP_TP.rules, "batch": (DATA, EXPERT), "expert": EXPERT},
)


def _stages_per_node(num_devices: int) -> int:
    # One stage per 8-device node (NVLink / ICI domain), so only the stage-to-stage
    # collective-permutes cross nodes; at least 2, so a single node still pipelines.
    return max(2, num_devices // MAX_MODEL_AXIS)


# Pipeline parallelism (GPipe / circular: zoo/layers/pipeline.py). The stacked layer weights
# `[L, ...]` are split on L over `stage`: stage s stores and runs L/stage consecutive layers;
# between stages only activations move (collective-permutes over `stage`: per micro-batch
# and repeat, forward and backward, and once to bring the rows in and hand them back), and
# under the circular schedule the weights once per step: this split is contiguous while that
# schedule runs layer chunk c on stage c mod S (pipeline.reorder_rounds).
# Inside a stage the table is fsdp's (or fsdp_tp's). Outside the layer stack the batch is
# split over `stage` as well: each stage embeds, and runs the LM head and the loss on, its
# own rows. Embeddings, the final norm and the LM head are replicated over `stage`; their
# gradients are all-reduced over `stage`, as data parallelism's are over `data`.
FSDP_PP = Strategy(
    name="fsdp_pp",
    axes=(STAGE, DATA),
    axis_caps={STAGE: _stages_per_node},
    rules={**FSDP.rules, "batch": (DATA, STAGE), "layers": STAGE},
)

FSDP_TP_PP = Strategy(
    name="fsdp_tp_pp",
    axes=(STAGE, DATA, MODEL),
    axis_caps={STAGE: _stages_per_node, MODEL: _at_most_node_and_sqrt},
    rules={**FSDP_TP.rules, "batch": (DATA, STAGE), "layers": STAGE},
)

# Expert parallelism inside pipeline stages (DeepSeek-V3 on H100 hosts: stages across nodes,
# experts within one): fsdp_ep's table inside each stage, the batch over `stage` outside the
# layer stack as fsdp_pp's. Each MoE layer's all-to-alls stay within its stage's `expert`
# group; only activations cross `stage`.
FSDP_EP_PP = Strategy(
    name="fsdp_ep_pp",
    axes=(STAGE, DATA, EXPERT),
    axis_caps={STAGE: _stages_per_node, EXPERT: _at_most_node},
    rules={**FSDP_EP.rules, "batch": (DATA, EXPERT, STAGE), "layers": STAGE},
)

STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for s in (
        DP,
        FSDP,
        TP,
        FSDP_TP,
        TP_SP,
        FSDP_TP_SP,
        HSDP,
        HSDP_TP,
        FSDP_CP,
        FSDP_TP_CP,
        FSDP_EP,
        FSDP_TP_EP,
        FSDP_PP,
        FSDP_TP_PP,
        FSDP_EP_PP,
    )
}


def get_strategy(name: str) -> Strategy:
    try:
        return STRATEGIES[name]
    except KeyError:
        valid = ", ".join(sorted(STRATEGIES))
        raise UsageError(f"unknown sharding strategy {name!r}; valid strategies: {valid}") from None
