"""DeepSeek-V3 (and the Kimi K2 / GLM models built on its architecture), as transformers'
`DeepseekV3ForCausalLM`: multi-head latent attention (zoo/layers/mla.py) in every layer; the
first `first_dense_layers` layers with a dense SwiGLU of width F, the rest a mixture of
experts routed by sigmoid scores with group-limited top-k, the auxiliary-loss-free correction
bias and shared experts (zoo/layers/moe_grouped.py).

The layers are two stacks (each scanned, or a list): `dense_blocks` (the first layers) then
`blocks` (the MoE layers), since a scan runs one block structure. Checkpoints number the
layers across both (hf layer i is dense_blocks[i] for i < k, else blocks[i - k]). Under a
pipeline strategy the schedule runs `blocks` and the dense layers run before it
(`before_stack`), on each stage's own rows.

Multi-token prediction (`mtp_depth` > 0; zoo/deepseek_v3/mtp.py): `mtp_blocks`, one module
per depth, trained beside the model through `nll_sum`; logits, generation and evaluation
never run them. Checkpoints hold depth k as layer num_layers + k - 1.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from nnx_zoo.errors import UsageError
from shardings.specs import BlockSharding, LmSharding
from zoo import loss
from zoo.deepseek_v3 import mtp
from zoo.layers.basic import Norm
from zoo.layers.config import DecoderConfig, causal_keys_per_query
from zoo.layers.decoder import Block, DecoderLM, NllSum, make_stack
from zoo.layers.kv_cache import KVCache
from zoo.layers.mla import MultiHeadLatentAttention, rope_frequencies, softmax_scale
from zoo.layers.mlp import Mlp
from zoo.layers.moe_grouped import GroupedMoe
from zoo.registry import experts, preset_table


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeepseekV3Config(DecoderConfig):
    MULTI_TOKEN_PREDICTION = True
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-6
    norm_topk_prob: bool = True
    # Multi-head latent attention (zoo/layers/mla.py). head_dim is qk_nope + qk_rope (q and
    # k's width per head) and num_kv_heads is num_heads (every head its own expanded key).
    q_lora_rank: int = 1536  # Q, the query latent; 0: queries by one [M, N, D] projection
    kv_lora_rank: int = 512  # C, the key/value latent the KV cache keeps
    qk_nope_head_dim: int = 128  # d, a head's q/k dims without rotation
    qk_rope_head_dim: int = 64  # r, the rotated q/k dims (the key's shared by every head)
    v_head_dim: int = 128  # Dv, a head's value dims
    rope_interleave: bool = True  # the checkpoint's rotary dims are interleaved pairs
    # YaRN on the rotary dims: (factor, original_max_position_embeddings, beta_fast,
    # beta_slow, mscale, mscale_all_dim; the last two 0 when absent), or None.
    rope_yarn: tuple | None = None
    # DeepSeek-V3 routing (zoo/layers/moe_grouped.py).
    moe_groups: int = 8  # n_group: the experts' groups
    moe_groups_per_tok: int = 4  # topk_group: groups a token's experts may come from
    routed_scaling_factor: float = 2.5  # on the routed experts' mixing weights
    num_shared_experts: int = 1  # n_shared_experts: one SwiGLU of this x moe_ffn_dim
    first_dense_layers: int = 3  # first_k_dense_replace: leading layers with a dense MLP

    def __post_init__(self):
        super().__post_init__()
        if self.num_layers <= self.first_dense_layers:
            # A model cut shorter than its dense prefix (the planner's one- and two-layer
            # twins, nnx_zoo/planning/forecast.py; a num_layers override) keeps MoE layers:
            # the ones whose cost scales with L. Per token a dense layer's MLP (F = 18432)
            # does the FLOPs of the 8 routed + 1 shared experts of 2048 it would replace.
            object.__setattr__(self, "first_dense_layers", 0)
        d, r = self.qk_nope_head_dim, self.qk_rope_head_dim
        if self.head_dim != d + r or self.num_kv_heads != self.num_heads:
            raise UsageError(
                f"head_dim={self.head_dim}, num_kv_heads={self.num_kv_heads}: multi-head latent "
                f"attention needs head_dim = qk_nope_head_dim + qk_rope_head_dim = {d + r} and "
                f"num_kv_heads = num_heads = {self.num_heads}"
            )
        if not (self.kv_lora_rank > 0 and r > 0 and r % 2 == 0 and 0 < self.v_head_dim <= d + r):
            raise UsageError(
                f"kv_lora_rank={self.kv_lora_rank}, qk_rope_head_dim={r}, v_head_dim="
                f"{self.v_head_dim}: need a latent, an even rotary width and 0 < v_head_dim <= "
                f"{d + r}"
            )
        if not self.num_experts or not 0 <= self.first_dense_layers < self.num_layers:
            raise UsageError(
                f"num_experts={self.num_experts}, first_dense_layers={self.first_dense_layers}: "
                f"DeepSeek-V3 needs experts and 0 <= first_dense_layers < num_layers="
                f"{self.num_layers}"
            )
        if self.use_bias or self.norm != "rms" or self.position != "rope":
            raise UsageError("DeepSeek-V3 has no projection biases, RMSNorm and RoPE only")
        if self.sliding_window:
            raise UsageError("DeepSeek-V3 attends globally: sliding_window must be None")

    @property
    def moe_layers(self) -> int:
        return self.num_layers - self.first_dense_layers

    @property
    def stacked_layers(self) -> int:
        return self.moe_layers  # `blocks`; the dense first layers are `dense_blocks`

    @property
    def softmax_scale(self) -> float:
        return softmax_scale(self)

    def _attention_params(self) -> int:
        M, N, Q, C = self.hidden_dim, self.num_heads, self.q_lora_rank, self.kv_lora_rank
        D, r, d, Dv = self.head_dim, self.qk_rope_head_dim, self.qk_nope_head_dim, self.v_head_dim
        q = M * Q + Q * N * D if Q else M * N * D
        return q + M * (C + r) + C * N * (d + Dv) + N * Dv * M

    def _layer_ffn(self, experts: int, dense: bool) -> int:
        M = self.hidden_dim
        if dense:
            return 3 * M * self.ffn_dim
        shared = 3 * M * self.moe_ffn_dim * self.num_shared_experts
        return experts * 3 * M * self.moe_ffn_dim + M * self.num_experts + shared

    def num_params(self, include_embedding: bool = True) -> int:
        """Every parameter, the multi-token-prediction modules' included (they share the
        embedding and the LM head, counted once)."""
        M, V, L, k = self.hidden_dim, self.vocab_size, self.num_layers, self.first_dense_layers
        norms = 2 * M + self.kv_lora_rank + self.q_lora_rank
        per_layer = self._attention_params() + norms
        moe_layer = self._layer_ffn(self.num_experts, False) + self.num_experts
        total = L * per_layer + k * self._layer_ffn(0, True) + (L - k) * moe_layer
        # Each MTP depth: enorm, hnorm, eh_proj [2M, M], a MoE layer, its head norm.
        total += self.mtp_depth * (3 * M + 2 * M * M + per_layer + moe_layer)
        total += M + (0 if self.tie_embeddings else M * V)
        return total + (V * M if include_embedding else 0)

    def _mtp_matmul_params(self) -> int:
        """Matmul params one token runs through per MTP depth: eh_proj, a MoE layer's
        attention and chosen experts, and the shared LM head again."""
        M, moe = self.hidden_dim, self._layer_ffn(self.num_experts_per_tok, False)
        return 2 * M * M + self._attention_params() + moe + M * self.vocab_size

    def matmul_params(self) -> int:
        L, k = self.num_layers, self.first_dense_layers
        ffn = k * self._layer_ffn(0, True) + (L - k) * self._layer_ffn(
            self.num_experts_per_tok, False
        )
        main = L * self._attention_params() + ffn + self.hidden_dim * self.vocab_size
        return main + self.mtp_depth * self._mtp_matmul_params()

    def flops_per_token(self, seq_len: int) -> float:
        """6 x matmul params, plus causal attention: per (query, key) pair 2 N D FLOPs for
        the scores and 2 N Dv for the weighted sum forward, three times that with backward.
        The MTP depths count as layers (training runs them; inference does not)."""
        keys = causal_keys_per_query(seq_len)
        per_pair = 6.0 * self.num_heads * (self.head_dim + self.v_head_dim)
        attention_layers = self.num_layers + self.mtp_depth
        return 6.0 * self.matmul_params() + attention_layers * per_pair * keys

    def cache_bytes_per_token(self, itemsize: int = 2) -> int:
        """KV-cache bytes per token, all layers: the latent and the rotary key."""
        return self.num_layers * (self.kv_lora_rank + self.qk_rope_head_dim) * itemsize


class DeepseekBlock(Block):
    """Block's forward (zoo/layers/decoder.py) over latent attention and either the dense
    MLP (`moe=False`) or the grouped mixture with shared experts."""

    def __init__(self, cfg, sharding: BlockSharding, *, moe: bool, rngs: nnx.Rngs):
        M = cfg.hidden_dim
        self.sharding = sharding
        norm = dict(eps=cfg.norm_eps, dtype=cfg.compute_dtype)
        self.attn_norm = Norm(M, sharding.attn_norm, **norm)
        self.attention = MultiHeadLatentAttention(cfg, sharding.mla, rngs=rngs)
        self.mlp_norm = Norm(M, sharding.mlp_norm, **norm)
        self.mlp = None if moe else Mlp(cfg, sharding.mlp, rngs=rngs)
        self.moe = GroupedMoe(cfg, sharding.moe, sharding.mlp, rngs=rngs) if moe else None
        self.post_attn_norm = self.post_mlp_norm = None


class DeepseekV3(DecoderLM):
    def __init__(self, cfg: DeepseekV3Config, sharding: LmSharding, *, rngs: nnx.Rngs):
        super().__init__(cfg, sharding, rngs=rngs)
        k = cfg.first_dense_layers
        dense = functools.partial(_dense_block, cfg, sharding)
        # Under a pipeline strategy the dense layers run before the schedule, on the rows as
        # embedded (split over `stage` too): whole on every stage, laid out for that.
        self.dense_blocks = (
            make_stack(cfg, sharding, rngs, k, dense, split_over_stages=False) if k else None
        )
        # Multi-token prediction: one module per depth, a list (each depth reads the last).
        self.mtp_blocks = (
            nnx.List(
                [
                    mtp.MtpModule(cfg, sharding, self.new_block(cfg, sharding, rngs), rngs=rngs)
                    for _ in range(cfg.mtp_depth)
                ]
            )
            if cfg.mtp_depth
            else None
        )

    @staticmethod
    def new_block(cfg, sharding, rngs):
        return DeepseekBlock(cfg, sharding.block, moe=True, rngs=rngs)

    def _layer_tables(self):
        inv_freq_R, _ = rope_frequencies(self.cfg)
        L = self.cfg.num_layers
        return [0] * L, np.stack([inv_freq_R] * L)

    def _run_scanned(self, x_BTM, segments, windows, freqs_LR, cache, kv_ctx):
        return self._two_stacks(self._scan_stack, x_BTM, segments, windows, freqs_LR, cache, kv_ctx)

    def _run_unscanned(self, x_BTM, segments, windows, freqs_LR, cache, kv_ctx):
        return self._two_stacks(self._loop_stack, x_BTM, segments, windows, freqs_LR, cache, kv_ctx)

    def _two_stacks(self, run, x_BTM, segments, windows, freqs_LR, cache, kv_ctx):
        """The dense stack, then the MoE stack, each with its layers' slice of the cache; the
        routing statistics are the MoE stack's."""
        k = self.cfg.first_dense_layers
        kvs = []
        if self.dense_blocks is not None:
            part = None if cache is None else (cache.k[:k], cache.v[:k])
            x_BTM, (kv, _) = run(
                self.dense_blocks, x_BTM, segments, windows[:k], freqs_LR[:k], part, kv_ctx
            )
            kvs.append(kv)
        part = None if cache is None else (cache.k[k:], cache.v[k:])
        x_BTM, (kv, stats) = run(
            self.blocks, x_BTM, segments, windows[k:], freqs_LR[k:], part, kv_ctx
        )
        kvs.append(kv)
        new_kv = None if cache is None else tuple(map(jnp.concatenate, zip(*kvs, strict=True)))
        return x_BTM, (new_kv, stats)

    def mtp_inv_freq(self):
        """The rope table of the MTP blocks: the MoE layers' (every layer has the same)."""
        return jnp.asarray(rope_frequencies(self.cfg)[0])

    def nll_sum(
        self,
        tokens_BT,
        *,
        segment_ids,
        positions,
        loss_mask_BT=None,
        chunk_size: int = 0,
        packed=True,
        layers=None,
    ) -> NllSum:
        """`DecoderLM.nll_sum`, and with `mtp_depth` > 0 the MTP depths' loss in `.mtp`
        (an `mtp.MtpLoss`; the trainer weights it by training.mtp_loss_weight)."""
        if not self.cfg.mtp_depth:
            return super().nll_sum(
                tokens_BT,
                segment_ids=segment_ids,
                positions=positions,
                loss_mask_BT=loss_mask_BT,
                chunk_size=chunk_size,
                packed=packed,
                layers=layers,
            )
        if layers is not None:
            raise UsageError(_NO_PIPELINE.format(self.cfg.mtp_depth))
        h_BTM, _, stats = self.hidden(
            tokens_BT, segment_ids=segment_ids, positions=positions, packed=packed
        )
        targets_BT, mask_BT = loss.target_mask(tokens_BT, segment_ids)
        if loss_mask_BT is not None:
            mask_BT = loss.answer_mask(mask_BT, loss_mask_BT)
        nll_BT = mtp.head_nll(self, h_BTM, targets_BT, mask_BT, chunk_size)
        extra = mtp.mtp_loss(
            self,
            h_BTM,
            tokens_BT,
            segment_ids,
            positions,
            loss_mask_BT=loss_mask_BT,
            chunk_size=chunk_size,
            packed=packed,
        )
        return NllSum(jnp.sum(nll_BT), jnp.sum(mask_BT), stats, extra)

    def balance_routing(self, load_LE, rate: float):
        """DeepSeek-V3's auxiliary-loss-free balancing: each routed expert's correction bias
        moves by `rate` towards balance, bias += rate * sign(1/E - load) (an expert under
        its mean share is chosen more often next step); rate 0 leaves it. `[L, E]` after."""
        moes = [self.blocks.moe] if self.cfg.scan_layers else [b.moe for b in self.blocks]
        bias_LE = jnp.concatenate(
            [m.e_score_correction_bias[...].reshape(-1, load_LE.shape[-1]) for m in moes]
        )
        if rate:
            step_LE = rate * jnp.sign(1.0 / load_LE.shape[-1] - load_LE)
            bias_LE = bias_LE + step_LE.astype(bias_LE.dtype)
            for i, m in enumerate(moes):
                var = m.e_score_correction_bias
                new = bias_LE if self.cfg.scan_layers else bias_LE[i]
                var.set_value(jax.sharding.reshard(new, jax.typeof(var[...]).sharding.spec))
        return bias_LE

    def before_stack(self, x_BTM, segments):
        """Under a pipeline strategy the schedule runs the MoE stack; the dense first layers
        run before it, here, as the model's own loop runs them."""
        if self.dense_blocks is None:
            return x_BTM
        k = self.cfg.first_dense_layers
        windows, freqs_LR = self._layer_tables()
        run = self._scan_stack if self.cfg.scan_layers else self._loop_stack
        x_BTM, _ = run(self.dense_blocks, x_BTM, segments, windows[:k], freqs_LR[:k], None, None)
        return x_BTM

    def init_cache(self, batch_size: int, max_len: int | None = None, dtype=None):
        """An empty latent cache: `k` [L, B, S, 1, C] the latents, `v` [L, B, S, 1, r] the
        rotated shared keys; every slot has segment id 0, which no real query attends."""
        cfg = self.cfg
        S = max_len or cfg.max_seq_len
        dtype = dtype or cfg.compute_dtype
        spec = P(None, *self.sharding.block.mla.cache)
        L, B = cfg.num_layers, batch_size
        tokens_spec = self.sharding.tokens
        return KVCache(
            k=jnp.zeros((L, B, S, 1, cfg.kv_lora_rank), dtype, out_sharding=spec),
            v=jnp.zeros((L, B, S, 1, cfg.qk_rope_head_dim), dtype, out_sharding=spec),
            segment_ids=jnp.zeros((B, S), jnp.int32, out_sharding=tokens_spec),
            positions=jnp.zeros((B, S), jnp.int32, out_sharding=tokens_spec),
            index=jnp.zeros((), jnp.int32),
        )


_NO_PIPELINE = (
    "model.mtp_depth={}: multi-token prediction does not run under a pipeline strategy "
    "(a schedule runs one layer stack); use one without `stage`, e.g. fsdp_ep, or "
    "model.mtp_depth=0"
)


def _dense_block(cfg, sharding: LmSharding, rngs: nnx.Rngs) -> DeepseekBlock:
    return DeepseekBlock(cfg, sharding.before_stack or sharding.block, moe=False, rngs=rngs)


def _mla(q_lora_rank, kv_lora_rank, nope, rope, v) -> dict:
    return {
        "q_lora_rank": q_lora_rank,
        "kv_lora_rank": kv_lora_rank,
        "qk_nope_head_dim": nope,
        "qk_rope_head_dim": rope,
        "v_head_dim": v,
    }


def _routing(groups, groups_per_tok, scaling, shared, dense) -> dict:
    return {
        "moe_groups": groups,
        "moe_groups_per_tok": groups_per_tok,
        "routed_scaling_factor": scaling,
        "num_shared_experts": shared,
        "first_dense_layers": dense,
    }


# deepseek-ai/DeepSeek-V3's config.json: YaRN factor 40 over 4096 positions.
_V3_YARN = (40.0, 4096, 32.0, 1.0, 1.0, 1.0)
PRESETS = preset_table(
    DeepseekV3Config,
    {
        # V, M, L, N, K, D, F, T (zoo.registry.PRESET_DIMS), then the experts (E, top k, each
        # expert's F), the latent attention and the routing. deepseek-v3-tiny, for tests and
        # CPU runs: 3 layers (1 dense), 8 experts in 2 groups (splittable by expert axes 2, 4,
        # 8), top 2 from 1 group, interleaved rope dims.
        "deepseek-v3-tiny": (
            512,
            64,
            3,
            4,
            4,
            24,
            96,
            256,
            {
                **experts(8, 2, 32),
                **_mla(32, 16, 16, 8, 16),
                **_routing(2, 1, 2.5, 1, 1),
            },
        ),
        "deepseek-v3": (
            129_280,
            7168,
            61,
            128,
            128,
            192,
            18_432,
            163_840,
            {
                **experts(256, 8, 2048),
                **_mla(1536, 512, 128, 64, 128),
                **_routing(8, 4, 2.5, 1, 3),
                "rope_yarn": _V3_YARN,
            },
        ),
    },
)

__all__ = ["PRESETS", "DeepseekV3", "DeepseekV3Config"]
