"""The decoder config every family shares; a family's Config subclasses it with its presets.

Fields are the knobs by which the families differ, so the shared blocks in zoo/layers/
serve all of them. Defaults are Llama 3's.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax.numpy as jnp

from nnx_zoo.errors import UsageError
from zoo.layers import quant, remat, rope
from zoo.layers.pipeline_schedules import resolve_schedule

SLIDING, FULL = "sliding_attention", "full_attention"
LAYER_TYPES = (SLIDING, FULL)
# attention_impl values: the backends of zoo/layers/attention/, and the choice between them.
ATTENTION_IMPLEMENTATIONS = ("xla", "splash", "cudnn", "auto")
# Fields that say how to run a model, not what it is: a checkpoint (its config.json, a run's
# --init_from) never fixes them, and a run's model section sets them on any architecture.
RUNTIME_FIELDS = (
    "dtype",
    "scan_layers",
    "scan_unroll",
    "remat",
    "attention_impl",
    "attention_interpret",
    "context_parallel",
    "moe_exchange",
    "moe_matmul",
    "moe_capacity_factor",
    "pipeline_microbatches",
    "pipeline_repeats",
    "pipeline_schedule",
    "quantization",
    "mtp_depth",
)

# moe_activation values: the experts' gated activation (zoo/layers/moe.py).
MOE_ACTIVATIONS = ("swiglu", "clamped_swiglu")

# context_parallel values: how attention sees the keys of a T split over `context`
# (zoo/layers/attention/context_parallel.py and ring.py).
CONTEXT_PARALLEL = ("all_gather", "ring")


def causal_keys_per_query(seq_len: int, window: int | None = None) -> float:
    """Mean number of keys a causal query sees in a row of `seq_len`: query t (1-based)
    sees min(t, w) with w visible keys (itself included); (T+1)/2 without a window."""
    T = seq_len
    w = min(window, T) if window else T
    return (w * (w + 1) / 2 + (T - w) * w) / T


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecoderConfig:
    vocab_size: int  # V, the token ids the model knows (a tokenizer's size)
    hidden_dim: int  # M, the residual width
    num_layers: int  # L
    num_heads: int  # N, query heads
    num_kv_heads: int  # K, key/value heads; divides N (K=N: MHA, K=1: MQA)
    head_dim: int  # D
    ffn_dim: int  # F
    max_seq_len: int = 8192  # KV-cache length, and the table size of learned positions
    # Rows of the embedding table and columns of the LM head when more than V (0: exactly V).
    # Set by zoo.plan.fit_vocab where V does not divide the mesh axes the vocab is split on
    # (GPT-2's 50257 under `tp`); the extra logits are masked out, never predicted.
    padded_vocab_size: int = 0

    norm: str = "rms"  # 'rms' | 'layer' (LayerNorm with bias, GPT-2)
    norm_eps: float = 1e-5
    norm_plus_one: bool = False  # Gemma: scale by (1 + w), w initialised to 0
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3, Gemma 3)
    post_norms: bool = False  # Gemma: norm each sub-block's output before the residual add
    use_bias: bool = False  # biases on every projection (GPT-2)

    activation: str = "silu"  # 'silu' | 'gelu_tanh' | 'gelu'
    glu: bool = True  # gated MLP (SwiGLU / GeGLU); False: up -> act -> down (GPT-2)

    position: str = "rope"  # 'rope' | 'learned' (GPT-2)
    rope_theta: float = 500_000.0
    # Llama 3 frequency scaling, as (factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings), or None; linear scaling as (factor,); YaRN as
    # (factor, beta_fast, beta_slow, original_max_position_embeddings, truncate).
    rope_scaling: tuple | None = None
    rope_local_theta: float | None = None  # Gemma 3: RoPE base of the sliding-window layers

    sliding_window: int | None = None  # tokens visible to a query, itself included
    # Every `global_every`-th layer (1-based) attends globally, the others use the window
    # (Gemma 3: 6). 0: all layers use the window when one is set (Mistral).
    global_every: int = 0
    # Per-layer attention kind, 'sliding_attention' | 'full_attention' (Hugging Face's names),
    # overriding `global_every` when set: checkpoints list one per layer (Gemma 3, Qwen3).
    layer_types: tuple[str, ...] | None = None
    attn_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    embed_scale: bool = False  # Gemma: multiply embeddings by sqrt(M)
    final_logit_softcap: float | None = None
    tie_embeddings: bool = False

    # Mixture of experts (0 experts: every block has the dense MLP above). Each token goes to
    # its top `num_experts_per_tok` of `num_experts` SwiGLU experts of width `moe_ffn_dim`.
    num_experts: int = 0  # E
    num_experts_per_tok: int = 0  # k, experts per token
    moe_ffn_dim: int = 0  # F of one expert
    # Renormalise the top-k router probabilities to sum to 1 (Mixtral always; Qwen3-MoE's
    # `norm_topk_prob`); False keeps them as softmax-over-all-experts values.
    norm_topk_prob: bool = True
    # Weight of the load-balancing loss (Switch Transformer form, as transformers computes it)
    # added to the training loss.
    router_aux_loss_coef: float = 0.0
    # How expert parallelism moves tokens (zoo/layers/moe_exchange.py): 'ragged' sends exactly
    # the routed rows (TPU, GPU), 'padded' fixed [e, C, M] buffers (what CPU can run), 'auto'
    # the first where it lowers. `moe_capacity_factor` sets the padded exchange's C =
    # ceil(factor x rows / e) per expert shard, dropping the overflow (counted in the
    # metrics); 0 is dropless (C = all rows).
    moe_exchange: str = "auto"
    moe_capacity_factor: float = 0.0
    # The experts' grouped matmul (zoo/layers/grouped_matmul.py): 'ragged_dot' (TPU's
    # grouped kernel; XLA:GPU computes every row against every local expert: E_local times
    # the FLOPs, temporaries X x E x M), 'tiled' (a loop over row tiles: memory flat in E,
    # each tile re-reading its expert's matrix), 'auto' (tiled on GPU, ragged_dot elsewhere).
    moe_matmul: str = "auto"

    # --- GPT-OSS (zoo/gpt_oss/) ---
    # A learned logit per query head that joins every query's softmax denominator and
    # takes no value (attention sinks): probs = exp(l) / (sum exp(l) + exp(sink)).
    attention_sinks: bool = False
    # Biases on the q/k/v/o projections alone (`use_bias` puts them on every projection).
    attention_bias: bool = False
    # Biases on the MoE router's logits and on each expert's gate, up and down projections.
    moe_bias: bool = False
    # The experts' activation: 'swiglu' (silu(gate) * up) or 'clamped_swiglu' (GPT-OSS:
    # gate clamped above at `swiglu_limit`, up to +-limit, gate * sigmoid(alpha * gate) *
    # (up + 1)).
    moe_activation: str = "swiglu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    dtype: str = "float32"  # compute dtype; parameters stay float32
    scan_layers: bool = True  # stack layers and run them with nnx.scan (one compiled block)
    # Layers per iteration of that scan: 1 keeps one compiled block; >= num_layers unrolls
    # it. 0 (auto) unrolls it on CPU when remat is 'none': there XLA's while loop zero-fills
    # the stacked activations the backward pass keeps and copies each layer's slice in and
    # out (a measurable share of a small model's train step). It stays rolled on TPU / GPU (compile
    # time) and with remat (unrolled, XLA CPU's schedule keeps every layer's activations
    # live, so remat would save nothing; bench/memory.py's docstring shows it).
    scan_unroll: int = 0
    # What the backward pass recomputes: a name in zoo/layers/remat.py's POLICIES.
    remat: str = "none"
    # 'xla' | 'splash' (TPU) | 'cudnn' (NVIDIA GPU) | 'auto' (splash on TPU, cudnn on GPU,
    # xla elsewhere); see zoo/layers/attention/.
    attention_impl: str = "xla"
    # Run Pallas attention kernels (splash) in interpret mode, so they run on CPU: for tests
    # and debugging only (slow).
    attention_interpret: bool = False
    # Strategies that split T over `context` (fsdp_cp, fsdp_tp_cp): 'all_gather' (each device
    # gathers every key and value of its rows) or 'ring' (K/V blocks passed around the
    # context axis by collective-permutes, attention per block with a running log-sum-exp:
    # K/V memory 1/context). Ignored by the other strategies.
    context_parallel: str = "all_gather"
    # Pipeline parallelism (strategies with a `stage` axis; zoo/layers/pipeline.py): the
    # micro-batches each step's batch is cut into (0: one per stage; at least the stages),
    # and the repeats (virtual stages per device: 1 is GPipe, more is the circular schedule,
    # layer chunk r*S + s on stage s). Ignored by the other strategies.
    pipeline_microbatches: int = 0
    pipeline_repeats: int = 1
    # The schedule (zoo/layers/pipeline.py): 'auto' (gpipe for repeats 1, circular above),
    # 'gpipe', 'circular' (repeats >= 2) or '1f1b' (repeats 1: one forward and one backward
    # per iteration, the final norm, LM head and loss inside the loop, so a stage keeps the
    # activations of at most 2S-1 micro-batches instead of every one; zoo/layers/
    # pipeline_1f1b.py).
    pipeline_schedule: str = "auto"
    # Operands of the attention and MLP projections (q, k, v, o, gate, up, down), forward and
    # backward: 'none' (the compute dtype) | 'fp8' (e4m3 / e5m2 gradients, per-tensor scales)
    # | 'int8' (per-row/column scales); see zoo/layers/quant.py. The LM head, the MoE router
    # and experts and the attention core stay in the compute dtype.
    quantization: str = "none"
    # Multi-token prediction (DeepSeek-V3, zoo/deepseek_v3/mtp.py): depths of extra
    # next-next-token heads trained beside the model; 0: none. A training choice, not what
    # the checkpoint fixes: import reads the checkpoint's MTP layers only when it is set.
    mtp_depth: int = 0
    # Whether the family builds multi-token prediction (a class constant, not a field).
    MULTI_TOKEN_PREDICTION: ClassVar[bool] = False

    def __post_init__(self):
        if self.mtp_depth < 0 or (self.mtp_depth and not self.MULTI_TOKEN_PREDICTION):
            raise UsageError(
                f"mtp_depth={self.mtp_depth}; valid: 0 (off), or >= 1 for a family with "
                "multi-token prediction (DeepSeek-V3)"
            )
        if self.num_heads % self.num_kv_heads:
            raise UsageError(
                f"num_heads={self.num_heads} is not divisible by num_kv_heads="
                f"{self.num_kv_heads}; grouped-query attention needs K | N"
            )
        remat.check_name(self.remat)
        if self.pipeline_microbatches < 0 or self.pipeline_repeats < 1:
            raise UsageError(
                f"pipeline_microbatches={self.pipeline_microbatches}, pipeline_repeats="
                f"{self.pipeline_repeats}; valid: microbatches >= 0 (0: one per stage), "
                "repeats >= 1 (1: GPipe)"
            )
        resolve_schedule(self.pipeline_schedule, self.pipeline_repeats)
        if self.pipeline_schedule == "1f1b" and remat.POLICIES[self.remat].offloads:
            raise UsageError(
                f"remat={self.remat!r} under pipeline_schedule='1f1b': the in-flight "
                "micro-batches' saved activations sit in the loop's device buffers, so "
                "nothing would move to host memory; use full, dots or another policy"
            )
        quant.check(self.quantization)
        if self.scan_unroll < 0:
            raise UsageError(
                f"scan_unroll={self.scan_unroll}; valid: 0 (auto: unrolled on CPU without "
                "remat, rolled otherwise), 1 (rolled) or more layers per scan iteration"
            )
        if self.padded_vocab_size and self.padded_vocab_size < self.vocab_size:
            raise UsageError(
                f"padded_vocab_size={self.padded_vocab_size} is below vocab_size="
                f"{self.vocab_size}; it is 0 (no padding) or at least vocab_size"
            )
        if self.dtype not in ("float32", "bfloat16"):
            raise UsageError(f"dtype={self.dtype!r}; valid: float32, bfloat16")
        if self.attention_impl not in ATTENTION_IMPLEMENTATIONS:
            raise UsageError(
                f"attention_impl={self.attention_impl!r}; valid: "
                f"{', '.join(ATTENTION_IMPLEMENTATIONS)}"
            )
        if self.context_parallel not in CONTEXT_PARALLEL:
            raise UsageError(
                f"context_parallel={self.context_parallel!r}; valid: {', '.join(CONTEXT_PARALLEL)}"
            )
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise UsageError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..num_experts="
                f"{self.num_experts}"
            )
        if self.moe_activation not in MOE_ACTIVATIONS:
            raise UsageError(
                f"moe_activation={self.moe_activation!r}; valid: {', '.join(MOE_ACTIVATIONS)}"
            )
        if self.moe_matmul not in ("auto", "ragged_dot", "tiled"):
            raise UsageError(f"moe_matmul={self.moe_matmul!r}; valid: auto, ragged_dot, tiled")
        if self.moe_exchange not in ("auto", "ragged", "padded"):
            raise UsageError(f"moe_exchange={self.moe_exchange!r}; valid: auto, ragged, padded")
        if not self.moe_capacity_factor >= 0:
            raise UsageError(
                f"moe_capacity_factor={self.moe_capacity_factor}; valid: 0 (dropless) or > 0"
            )
        if self.num_experts and self.moe_ffn_dim < 1:
            raise UsageError(f"moe_ffn_dim={self.moe_ffn_dim}; an MoE config needs it >= 1")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise UsageError(
                    f"layer_types has {len(self.layer_types)} entries for num_layers="
                    f"{self.num_layers}"
                )
            bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if bad:
                raise UsageError(f"layer_types {bad} unknown; valid: {', '.join(LAYER_TYPES)}")

    @property
    def vocab_rows(self) -> int:
        """Rows of the embedding table (and LM head columns): V, or V padded."""
        return max(self.vocab_size, self.padded_vocab_size)

    @property
    def compute_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def softmax_scale(self) -> float:
        scale = self.attn_scale if self.attn_scale is not None else self.head_dim**-0.5
        # YaRN scales cos and sin, so q and k, by its attention factor: the logits by its square.
        return scale * rope.attention_factor(self.rope_scaling) ** 2

    def layer_windows(self) -> list[int]:
        """Per-layer window (0 = global), from `sliding_window` and `layer_types` or
        `global_every`."""
        if not self.sliding_window:
            return [0] * self.num_layers
        if self.layer_types is not None:
            return [self.sliding_window if t == SLIDING else 0 for t in self.layer_types]
        if not self.global_every:
            return [self.sliding_window] * self.num_layers
        return [
            0 if (i + 1) % self.global_every == 0 else self.sliding_window
            for i in range(self.num_layers)
        ]

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def moe_layers(self) -> int:
        """Layers whose feed-forward is the mixture (DeepSeek-V3's first layers are dense)."""
        return self.num_layers if self.is_moe else 0

    @property
    def stacked_layers(self) -> int:
        """Layers of the main stack (`blocks`: the one a pipeline splits into stages). A
        family whose first layers differ in structure (DeepSeek-V3's dense ones) stacks
        those apart, and this is the rest."""
        return self.num_layers

    def _ffn_params(self, experts: int) -> int:
        """Per-layer feed-forward weights: the dense MLP, or `experts` experts and the router."""
        M = self.hidden_dim
        if not self.is_moe:
            return M * self.ffn_dim * (3 if self.glu else 2)
        biases = (experts * (2 * self.moe_ffn_dim + M) + self.num_experts) if self.moe_bias else 0
        return experts * 3 * M * self.moe_ffn_dim + M * self.num_experts + biases

    def replace(self, **changes) -> DecoderConfig:
        return dataclasses.replace(self, **changes)

    def num_params(self, include_embedding: bool = True) -> int:
        M, N, K, D, F, V = (
            self.hidden_dim,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.ffn_dim,
            self.vocab_size,
        )
        attn = M * N * D * 2 + M * K * D * 2
        mlp = self._ffn_params(self.num_experts)
        # LayerNorm carries a bias beside its scale.
        norm_size = M * (2 if self.norm == "layer" else 1)
        norms = norm_size * (4 if self.post_norms else 2) + (2 * D if self.qk_norm else 0)
        biases = (N * D + 2 * K * D + M + F * (2 if self.glu else 1) + M) if self.use_bias else 0
        if self.attention_bias and not self.use_bias:
            biases = N * D + 2 * K * D + M
        sinks = N if self.attention_sinks else 0
        per_layer = attn + mlp + norms + biases + sinks
        total = self.num_layers * per_layer + norm_size + (0 if self.tie_embeddings else M * V)
        if include_embedding:
            total += V * M
            if self.position == "learned":
                total += self.max_seq_len * M
        return total

    def matmul_params(self) -> int:
        """Weights that enter a matmul per token: every layer's, plus the LM head. Of an MoE
        layer only the router and the k experts a token is sent to count (active params)."""
        M, N, K, D = self.hidden_dim, self.num_heads, self.num_kv_heads, self.head_dim
        per_layer = M * N * D * 2 + M * K * D * 2 + self._ffn_params(self.num_experts_per_tok)
        return self.num_layers * per_layer + M * self.vocab_size

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 * matmul params, plus causal attention.

        Attention scores and the weighted sum each cost 2*N*D FLOPs per (query, key) pair
        forward, and the backward pass twice the forward: 12 * N * D per pair. A causal
        query sees on average C keys: (T+1)/2 without a window; with a window of w visible
        keys (w' = min(w, T)), C = (w'(w'+1)/2 + (T-w') w') / T, counted exactly.
        """
        total = 6.0 * self.matmul_params()
        for window in self.layer_windows():
            keys = causal_keys_per_query(seq_len, window or None)
            total += 12.0 * self.num_heads * self.head_dim * keys
        return total

    def describe(self) -> str:
        n = self.num_params()
        scale = 1e9 if n >= 1e9 else 1e6
        unit = "B" if n >= 1e9 else "M"
        return (
            f"{type(self).__name__}: {n / scale:.{1 if math.log10(n) > 7 else 2}f}{unit} params,"
            f" L={self.num_layers} M={self.hidden_dim} N={self.num_heads} K={self.num_kv_heads}"
            f" D={self.head_dim} F={self.ffn_dim} V={self.vocab_size}"
            + (f" (padded to {self.vocab_rows})" if self.vocab_rows > self.vocab_size else "")
            + (
                f" E={self.num_experts} k={self.num_experts_per_tok} F_expert={self.moe_ffn_dim}"
                if self.is_moe
                else ""
            )
        )
