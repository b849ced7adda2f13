"""Sharding as data: one frozen dataclass per module kind.

Each holds the layout of the weights a module creates and of the activation it returns. A
module stores its dataclass at construction, attaches the weight specs to its variables
(`out_sharding=` metadata) and passes `out` as `out_sharding=` to the op it calls. Nothing
here decides a layout; `shardings/strategies.py` fills these for a whole model.

Dims, one set of letters everywhere: B batch, T query positions, S key/value positions,
M model (residual) width, N query heads, K key/value heads, G = N // K query heads per kv
head, D head dim, R = D / 2 rotary frequencies, F FFN width, V vocab, L layers, P prompt
positions, O generated (output) tokens, E experts, X token-to-expert assignments
(tokens * k).
"""

from __future__ import annotations

import dataclasses
import math

from jax.sharding import PartitionSpec as P

REPLICATED = P()


@dataclasses.dataclass(frozen=True)
class LinearSharding:
    """A contraction with a weight: `weight` is the kernel's layout, `out` the result's.

    `bias` is the layout of the optional bias over the output features; it must match the
    output's feature dims, or broadcasting re-imposes its layout on the result.
    """

    weight: P
    out: P
    bias: P = REPLICATED


@dataclasses.dataclass(frozen=True)
class EmbeddingSharding:
    table: P  # [V, M] (or [T_max, M] for learned positions)
    out: P  # [B, T, M]


@dataclasses.dataclass(frozen=True)
class NormSharding:
    weight: P  # [M] scale (and bias, for LayerNorm)
    out: P  # layout of the normalized activation: where the norm hands it on


@dataclasses.dataclass(frozen=True)
class AttentionSharding:
    q: LinearSharding  # [M, N, D] -> [B, T, N, D]
    k: LinearSharding  # [M, K, D] -> [B, T, K, D]
    v: LinearSharding  # [M, K, D] -> [B, T, K, D]
    o: LinearSharding  # [N, D, M] -> residual [B, T, M]
    q_norm: NormSharding  # per-head norm over D (Qwen3, Gemma 3); out = q heads
    k_norm: NormSharding
    kv_cache: P  # [B, S, K, D], for generation
    sinks: P = REPLICATED  # [N] attention-sink logits (GPT-OSS)


@dataclasses.dataclass(frozen=True)
class MlaSharding:
    """Multi-head latent attention (DeepSeek-V2/V3; zoo/layers/mla.py). Q is the query
    latent's width (q_lora_rank), C the key/value latent's (kv_lora_rank), r the rotary key
    dims shared by every head; D is a head's q/k width, or v's in `kv_b` and `o`."""

    q: LinearSharding  # [M, N, D] -> [B, T, N, D] (no query latent)
    q_a: LinearSharding  # [M, Q] -> [B, T, Q]
    q_a_norm: NormSharding  # over Q
    q_b: LinearSharding  # [Q, N, D] -> [B, T, N, D]
    kv_a: LinearSharding  # [M, C + r] -> [B, T, C + r]
    kv_a_norm: NormSharding  # over C
    kv_b: LinearSharding  # [C, N, D_k + D_v] -> [B, T, N, D_k + D_v]
    o: LinearSharding  # [N, D_v, M] -> residual [B, T, M]
    heads: P  # [B, T, N, D]: queries, expanded keys and values, the attention output
    cache: P  # [B, S, 1, C] the latent and [B, S, 1, r] the rotary key, for generation


@dataclasses.dataclass(frozen=True)
class MlpSharding:
    gate: LinearSharding  # [M, F] -> [B, T, F]
    up: LinearSharding  # [M, F] -> [B, T, F]
    down: LinearSharding  # [F, M] -> residual [B, T, M]


@dataclasses.dataclass(frozen=True)
class MoeSharding:
    """A mixture-of-experts feed-forward: router, experts stacked on E, and where tokens go.

    The expert compute runs inside `jax.shard_map` over the mesh axes named here, so each
    device sorts only its own tokens; `*_compute` are the expert weights' layouts inside it
    (the stored layouts' FSDP split gathered).
    """

    router: LinearSharding  # [M, E] -> router logits [B, T, E]
    gate: P  # [E, M, F] stored
    up: P  # [E, M, F]
    down: P  # [E, F, M]
    gate_compute: P  # [E, M, F] as the expert matmuls read it
    up_compute: P
    down_compute: P
    tokens: P  # [B, T, M] tokens entering the expert compute; [B, T, k] routing likewise
    # [E, X, M]: tokens after dispatch, grouped by the expert shard that computes them (the
    # all-to-all's result); E's entry is the expert axis.
    dispatched: P
    out: P  # [B, T, M] the block's output, back in token order
    expert_axis: str | None  # mesh axis the experts are split over; tokens all-to-all over it
    ffn_axis: str | None  # mesh axis F is split over; partial sums of `down` reduced over it
    # Expert biases (GPT-OSS), stored and as the expert compute reads them: [E, F] for gate
    # and up, [E, M] for down.
    gate_bias: P = REPLICATED
    down_bias: P = REPLICATED
    gate_bias_compute: P = REPLICATED
    down_bias_compute: P = REPLICATED


@dataclasses.dataclass(frozen=True)
class BlockSharding:
    residual: P  # [B, T, M], the stream between blocks
    attn_norm: NormSharding
    attention: AttentionSharding
    post_attn_norm: NormSharding  # Gemma-style norm on the block's output, before the add
    mlp_norm: NormSharding
    mlp: MlpSharding
    post_mlp_norm: NormSharding
    moe: MoeSharding  # used instead of `mlp` by MoE configs
    # Multi-head latent attention, used instead of `attention` by MLA configs (DeepSeek-V3).
    mla: MlaSharding | None = None


@dataclasses.dataclass(frozen=True)
class MtpSharding:
    """A multi-token-prediction depth (DeepSeek-V3; zoo/deepseek_v3/mtp.py) around its
    block, which takes `BlockSharding`'s layouts as the model's own blocks do."""

    enorm: NormSharding  # over the embedding of the token k ahead
    hnorm: NormSharding  # over the previous depth's hidden state
    eh_proj: LinearSharding  # [2M, M] -> residual [B, T, M]
    head_norm: NormSharding  # before the shared LM head


@dataclasses.dataclass(frozen=True)
class LmSharding:
    tokens: P  # [B, T] for tokens, segment ids, positions
    embed: EmbeddingSharding
    position_embed: EmbeddingSharding  # learned positions (GPT-2): [T_max, M]
    block: BlockSharding  # every layer; stacked weights get a leading L dim (`stacked`)
    final_norm: NormSharding
    lm_head: LinearSharding  # [M, V] -> logits [B, T, V]
    # With T split (context parallelism): "balanced" keeps rows inside the model in
    # load-balanced chunk order (device i holds chunks i and 2c-1-i of 2c), "natural" in
    # index order. Inputs and logits are always in index order.
    seq_order: str = "natural"
    # Pipeline parallelism: the mesh axis the stacked layers' L dim is split over (stage s
    # holds a contiguous L/stage block and runs it; zoo/layers/pipeline.py), or None.
    stage_axis: str | None = None
    # Layers run before a pipeline's schedule (DeepSeek-V3's dense first layers), their rows
    # split over `stage` too; None: no pipeline (such layers are laid out as `block`).
    before_stack: BlockSharding | None = None
    # Multi-token prediction's own weights (DeepSeek-V3 with mtp_depth > 0).
    mtp: MtpSharding | None = None


def normalize(spec: P | None, rank: int) -> P:
    """`spec` padded with None to `rank` dims, so equal layouts compare equal."""
    entries = tuple(spec or ()) + (None,) * (rank - len(spec or ()))
    return P(*entries)


def axes_of(entry) -> tuple[str, ...]:
    """The mesh axes of one spec entry: None -> (), 'data' -> ('data',), a tuple as is."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def entry_size(entry, mesh_shape) -> int:
    """How many ways one spec entry splits its dim: the product of its axes' sizes."""
    return math.prod(mesh_shape[a] for a in axes_of(entry))


def split_size(spec: P | None, dim: int, mesh_shape) -> int:
    """How many ways `spec` splits dim `dim` (1 when it does not)."""
    return entry_size(normalize(spec, dim + 1)[dim], mesh_shape)
