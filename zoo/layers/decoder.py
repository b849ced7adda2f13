"""The decoder-only LM every family is built from: embedding, blocks, final norm, LM head.

Layers are stacked (one set of weights with a leading L dim, created with `nnx.vmap` and run
with `nnx.scan`, so the block compiles once) or, for debugging, kept as a list.

The model knows no pipeline schedule. It exports what one needs (zoo/layers/stage.py): its
layer stack (`layer_stack`) and its end (`loss_head`); its embedding (`embed_tokens`);
and `hidden` / `forward` / `token_nll` / `nll_sum` take `layers`, a function that runs the
layer stack in place of the model's own loop. zoo/pipelined.py picks the schedule.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from nnx_zoo.errors import UsageError
from shardings.mesh import check_batch, compile_platform
from shardings.specs import BlockSharding, LmSharding, axes_of
from zoo import loss
from zoo.layers import kv_cache, quant, remat, rope, stage
from zoo.layers.attention import Attention, CallInfo, Segments, context_parallel
from zoo.layers.attention.registry import backend, resolve_implementation
from zoo.layers.basic import Einsum, Embed, Norm
from zoo.layers.config import DecoderConfig
from zoo.layers.kv_cache import KVCache, LayerCache
from zoo.layers.mlp import Mlp
from zoo.layers.moe import Moe, moe_stats, zero_stats
from zoo.layers.stage import LossHead, Rows, Stack
from zoo.lm_head_loss import Head, chunk_nll, chunked_token_nll, drop_vocab_padding

# Params with a vocab dim, by path, and which dim it is: the rows a padded vocab
# (cfg.padded_vocab_size) adds, which checkpoints and Hugging Face files convert.
VOCAB_DIMS = {"embed/table": 0, "lm_head/weight": 1}


class LmOutput(NamedTuple):
    logits_BTV: jax.Array
    cache: object  # KVCache, or None when called without one
    router_stats: object  # MoeStats, or None for a dense model


class NllSum(NamedTuple):
    total: jax.Array  # next-token NLL summed over the counted positions, float32
    count: jax.Array  # how many positions count
    router_stats: object  # MoeStats, or None for a dense model
    # Multi-token prediction's loss (zoo/deepseek_v3/mtp.py's MtpLoss), None without it.
    mtp: object = None


class TokenNll(NamedTuple):
    nll_BT: jax.Array  # next-token NLL, float32
    mask_BT: jax.Array  # which positions count (not padding, not a document's last token)
    router_stats: object  # MoeStats, or None for a dense model


class LayerConsts(NamedTuple):
    """A layer's constants, per layer of the stack (`[L]`, `[L, D/2]`)."""

    window: np.ndarray  # attention window (0: none)
    inv_freq: np.ndarray  # rope inverse frequencies


def _to_compute_dtype(params, dtype, matmul_ndim: int):
    """`params` with the matmul weights (`matmul_ndim`+ dims, float32) cast to `dtype`: the
    values each Einsum would cast to itself (an astype of an astype is the same); norm scales
    and biases stay float32, as the norms compute in float32."""
    if jnp.dtype(dtype) == jnp.float32:
        return params

    def cast(x):
        if x.ndim >= matmul_ndim and x.dtype == jnp.float32:
            return x.astype(dtype)
        return x

    return jax.tree.map(cast, params)


class Block(nnx.Module):
    def __init__(self, cfg: DecoderConfig, sharding: BlockSharding, *, rngs: nnx.Rngs):
        M = cfg.hidden_dim
        self.sharding = sharding
        norm = dict(
            kind=cfg.norm, eps=cfg.norm_eps, plus_one=cfg.norm_plus_one, dtype=cfg.compute_dtype
        )
        self.attn_norm = Norm(M, sharding.attn_norm, **norm)
        self.attention = Attention(cfg, sharding.attention, rngs=rngs)
        self.mlp_norm = Norm(M, sharding.mlp_norm, **norm)
        # An MoE config puts its experts where the dense MLP would be.
        self.mlp = None if cfg.is_moe else Mlp(cfg, sharding.mlp, rngs=rngs)
        self.moe = Moe(cfg, sharding.moe, rngs=rngs) if cfg.is_moe else None
        if cfg.post_norms:
            self.post_attn_norm = Norm(M, sharding.post_attn_norm, **norm)
            self.post_mlp_norm = Norm(M, sharding.post_mlp_norm, **norm)
        else:
            self.post_attn_norm = self.post_mlp_norm = None

    def __call__(self, x_BTM, segments: Segments, *, window, inv_freq_R, kv=None):
        x_BTM = remat.tag(x_BTM, remat.RESIDUAL)
        with jax.named_scope("attention"):
            h_BTM, kv = self.attention(
                self.attn_norm(x_BTM),
                segments,
                window=window,
                inv_freq_R=inv_freq_R,
                kv=kv,
            )
            if self.post_attn_norm is not None:
                h_BTM = self.post_attn_norm(h_BTM)
        x_BTM = remat.tag(x_BTM + h_BTM, remat.RESIDUAL)
        router_stats = None
        with jax.named_scope("mlp"):
            if self.moe is None:
                h_BTM = self.mlp(self.mlp_norm(x_BTM))
            else:
                h_BTM, router_stats = self.moe(self.mlp_norm(x_BTM), segments.q_ids_BT != 0)
            if self.post_mlp_norm is not None:
                h_BTM = self.post_mlp_norm(h_BTM)
        return x_BTM + h_BTM, (kv, router_stats)


def _needs_trace(sharding: LmSharding) -> bool:
    """A layout whose model runs shard_map regions (context-parallel attention), which an
    eager call cannot enter."""
    return context_parallel.seq_axis(sharding.tokens) is not None or sharding.stage_axis is not None


@nnx.jit(static_argnames=("packed",))
def _traced_call(model, tokens_BT, segment_ids, positions, packed):
    return model(tokens_BT, segment_ids=segment_ids, positions=positions, packed=packed)


def make_stack(
    cfg: DecoderConfig,
    sharding: LmSharding,
    rngs: nnx.Rngs,
    count: int,
    new_block,
    *,
    split_over_stages: bool = True,
):
    """`count` blocks from `new_block(rngs)`: stacked on a leading L dim (`cfg.scan_layers`,
    created with `nnx.vmap`, L split over the pipeline's stage axis if any, unless the
    blocks run before the schedule: `split_over_stages` False) or a list."""
    stage_axis = sharding.stage_axis if split_over_stages else None
    if not cfg.scan_layers:
        return nnx.List([new_block(rngs) for _ in range(count)])

    @nnx.split_rngs(splits=count)
    # L is split over the pipeline's stage axis, if any (None: never split).
    @nnx.vmap(
        in_axes=0,
        out_axes=0,
        transform_metadata={nnx.PARTITION_NAME: stage_axis},
    )
    def make_blocks(rngs):
        return new_block(rngs)

    blocks = make_blocks(rngs)
    if stage_axis is not None:
        # vmap records the stage split in the metadata but creates L unsplit.
        for _, var in nnx.to_flat_state(nnx.state(blocks)):
            spec = var.get_metadata().get("out_sharding")
            var.set_value(jax.sharding.reshard(var.get_value(), P(*spec)))
    return blocks


class DecoderLM(nnx.Module):
    def __init__(self, cfg: DecoderConfig, sharding: LmSharding, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.sharding = sharding
        # V here is the table's rows: the vocabulary, padded when it must divide its split.
        V, M, dtype = cfg.vocab_rows, cfg.hidden_dim, cfg.compute_dtype
        self.embed = Embed(V, M, sharding.embed, rngs=rngs, dtype=dtype)
        self.position_embed = (
            Embed(cfg.max_seq_len, M, sharding.position_embed, rngs=rngs, dtype=dtype)
            if cfg.position == "learned"
            else None
        )
        new_block = functools.partial(type(self).new_block, cfg, sharding)
        self.blocks = make_stack(cfg, sharding, rngs, cfg.stacked_layers, new_block)
        self.final_norm = Norm(
            M,
            sharding.final_norm,
            kind=cfg.norm,
            eps=cfg.norm_eps,
            plus_one=cfg.norm_plus_one,
            dtype=dtype,
        )
        self.lm_head = (
            None
            if cfg.tie_embeddings
            else Einsum("BTM,MV->BTV", (M, V), sharding.lm_head, rngs=rngs, dtype=dtype)
        )

    # A family whose blocks differ (zoo/deepseek_v3: latent attention) overrides this: the
    # block of the layer stack, which holds `cfg.stacked_layers` layers.
    @staticmethod
    def new_block(cfg: DecoderConfig, sharding: LmSharding, rngs: nnx.Rngs) -> nnx.Module:
        return Block(cfg, sharding.block, rngs=rngs)

    # -- per-layer constants -------------------------------------------------------------

    def _layer_tables(self):
        """(windows, rope tables): a Python value when every layer agrees (so backends that
        need a static window get one), else a per-layer array for the scan to slice."""
        cfg = self.cfg
        windows = cfg.layer_windows()
        global_freq = rope.inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        if cfg.rope_local_theta is None:
            freqs = [global_freq] * cfg.num_layers
        else:
            local_freq = rope.inverse_frequencies(cfg.head_dim, cfg.rope_local_theta)
            freqs = [local_freq if w else global_freq for w in windows]
        return windows, np.stack(freqs)

    # -- forward -------------------------------------------------------------------------

    def __call__(self, tokens_BT, *, segment_ids, positions, packed=True):
        """Logits [B, T, V] in float32 (`forward` also gives the cache and routing stats).

        B must divide over the mesh axes the layout splits it over (UsageError naming B, the
        axes and their size). Called outside jit under a context-parallel layout, whose
        shard_map regions need a trace, it runs itself under `nnx.jit`."""
        mesh = jax.sharding.get_abstract_mesh()
        if not mesh.empty:
            check_batch(
                tokens_BT.shape[0],
                self.sharding.tokens,
                mesh,
                "model input tokens [B, T]",
                seq_len=tokens_BT.shape[1],
            )
            # Inputs made without a layout (jnp.zeros under the mesh) take the model's.
            tokens_BT, segment_ids, positions = (
                jax.sharding.reshard(a, self.sharding.tokens)
                for a in (tokens_BT, segment_ids, positions)
            )
        if _needs_trace(self.sharding) and not isinstance(tokens_BT, jax.core.Tracer):
            return _traced_call(self, tokens_BT, segment_ids, positions, packed)
        return self.forward(
            tokens_BT, segment_ids=segment_ids, positions=positions, packed=packed
        ).logits_BTV

    def forward(
        self, tokens_BT, *, segment_ids, positions, cache=None, packed=True, layers=None
    ) -> LmOutput:
        """Logits [B, T, V] in float32, the updated `cache` (see `init_cache`; None without
        one) and the MoE routing statistics (None for a dense model).

        V is the true vocabulary: with a padded one (`cfg.padded_vocab_size`) the padding
        columns are dropped, which gathers the logits over the vocab split first. `layers`
        as in `hidden`.
        """
        x_BTM, new_cache, stats = self.hidden(
            tokens_BT,
            segment_ids=segment_ids,
            positions=positions,
            cache=cache,
            packed=packed,
            layers=layers,
        )
        logits_BTV = drop_vocab_padding(self._logits(x_BTM), self.cfg.vocab_size)
        return LmOutput(logits_BTV, new_cache, stats)

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
        """The next-token NLL summed over the positions that count, their count, and the MoE
        routing statistics: what training differentiates (sums add over micro-batches and
        devices before the one division by the count).

        `loss_mask_BT` (chat / instruction data): only positions whose target token is
        marked count. `chunk_size` as in `token_nll`, `layers` as in `hidden`.
        """
        nll_BT, mask_BT, stats = self.token_nll(
            tokens_BT,
            segment_ids=segment_ids,
            positions=positions,
            chunk_size=chunk_size,
            packed=packed,
            layers=layers,
        )
        if loss_mask_BT is not None:
            mask_BT = loss.answer_mask(mask_BT, loss_mask_BT)
            nll_BT = jnp.where(mask_BT, nll_BT, 0.0)
        return NllSum(jnp.sum(nll_BT), jnp.sum(mask_BT), stats)

    def token_nll(
        self,
        tokens_BT,
        *,
        segment_ids,
        positions,
        chunk_size: int = 0,
        packed=True,
        layers=None,
    ) -> TokenNll:
        """Next-token NLL in float32 per position, which positions count, and the MoE routing
        statistics (None for a dense model).

        `chunk_size` > 0 fuses the LM head with the loss over chunks of about that many
        tokens per device (zoo/lm_head_loss.py), so full `[B, T, V]` logits never exist, in
        the forward or the backward pass; 0 computes the full logits first
        (`zoo.loss.token_nll`). `layers` as in `hidden`.
        """
        x_BTM, _, stats = self.hidden(
            tokens_BT, segment_ids=segment_ids, positions=positions, packed=packed, layers=layers
        )
        if not chunk_size:
            nll_BT, mask_BT = loss.token_nll(self._logits(x_BTM), tokens_BT, segment_ids)
        else:
            targets_BT, mask_BT = loss.target_mask(tokens_BT, segment_ids)
            with jax.named_scope("lm_head_loss"):
                weight, head = self._head()
                nll_BT = chunked_token_nll(x_BTM, weight, targets_BT, mask_BT, head, chunk_size)
        return TokenNll(nll_BT, mask_BT, stats)

    def hidden(self, tokens_BT, *, segment_ids, positions, cache=None, packed=True, layers=None):
        """(final-normed hidden states x_BTM, updated cache or None, MoeStats or None): the
        model up to its LM head.

        `layers(x_BTM, segments) -> (x_BTM, per-layer router statistics or None)`, when
        given, runs the layer stack in place of the model's own loop (a pipeline schedule:
        zoo/pipelined.py), after `before_stack`; no cache then."""
        cfg = self.cfg
        # Context parallelism: rows run in load-balanced chunk order inside the model
        # (zoo/layers/attention/context_parallel.py); the residual goes back before the LM head.
        cp_axis = context_parallel.seq_axis(self.sharding.tokens)
        balanced = cp_axis is not None and self.sharding.seq_order == "balanced"
        sp_axis = context_parallel.seq_axis(self.sharding.block.residual)
        if cache is not None and cp_axis is None and sp_axis is not None:
            # A decode step has T = 1 token per row: nothing to split over the axis.
            raise UsageError(
                f"KV-cache decoding (generation) does not split the residual's T over "
                f"`{sp_axis}` (sequence parallelism); generate with a strategy without it, "
                "e.g. --sharding_strategy=fsdp_tp"
            )
        if balanced:
            if cache is not None:
                raise UsageError(
                    "KV-cache decoding (generation) does not split T over `context`; "
                    "generate with a strategy without it, e.g. --sharding_strategy=fsdp"
                )
            tokens_BT, segment_ids, positions = (
                context_parallel.to_balanced(a, cp_axis)
                for a in (tokens_BT, segment_ids, positions)
            )
        x_BTM = self.embed_tokens(tokens_BT, positions)

        # `packed=False` states one document per row from index 0, then padding: attention
        # backends that take sequence lengths (cuDNN) then need no document mask.
        segments = Segments.self_attention(segment_ids, positions, packed=packed)
        # What every layer's cache shares: segment ids and positions with this step's tokens.
        kv_ctx = None
        if cache is not None:
            kv_segment_ids = kv_cache.write(cache.segment_ids, segment_ids, cache.index)
            kv_positions = kv_cache.write(cache.positions, positions, cache.index)
            kv_ctx = (kv_segment_ids, kv_positions, cache.index)

        windows, freqs_LR = self._layer_tables()
        if layers is None and cache is None and self.sharding.stage_axis is not None:
            layers = stage.default_layers(self)  # a plain call: the forward schedule
        if layers is not None:
            if cache is not None:
                raise UsageError(
                    "KV-cache decoding (generation) does not run under a pipeline strategy; "
                    "generate with one without a `stage` axis, e.g. --sharding_strategy=fsdp"
                )
            x_BTM = self.before_stack(x_BTM, segments)
            x_BTM, stats = layers(x_BTM, segments)
            new_kv = None
        else:
            run = self._run_scanned if cfg.scan_layers else self._run_unscanned
            x_BTM, (new_kv, stats) = run(x_BTM, segments, windows, freqs_LR, cache, kv_ctx)

        if balanced:
            x_BTM = context_parallel.from_balanced(x_BTM, cp_axis)
        x_BTM = self.final_norm(x_BTM)
        stats = moe_stats(stats, cfg.num_experts) if cfg.is_moe else None
        if cache is None:
            return x_BTM, None, stats
        k_LBSKD, v_LBSKD = new_kv
        new_cache = KVCache(k_LBSKD, v_LBSKD, *kv_ctx[:2], cache.index + tokens_BT.shape[1])
        return x_BTM, new_cache, stats

    def before_stack(self, x_BTM, segments):
        """The layers a pipeline's schedule does not run, before it (its rows split over
        `stage` too, laid out by `LmSharding.before_stack`): none here; DeepSeek-V3's dense
        first layers."""
        del segments
        return x_BTM

    def stage_input(self, tokens_BT, *, segment_ids, positions, packed=True):
        """What a pipeline schedule takes in: the embedded rows through `before_stack`."""
        x_BTM = self.embed_tokens(tokens_BT, positions)
        segments = Segments.self_attention(segment_ids, positions, packed=packed)
        return self.before_stack(x_BTM, segments)

    def embed_tokens(self, tokens_BT, positions):
        """The token (and learned position) embeddings, scaled where the family scales them."""
        cfg = self.cfg
        with jax.named_scope("embed"):
            x_BTM = self.embed(tokens_BT)
            if cfg.embed_scale:
                x_BTM = x_BTM * jnp.asarray(cfg.hidden_dim**0.5, x_BTM.dtype)
            if self.position_embed is not None:
                x_BTM = x_BTM + self.position_embed(positions)
        return x_BTM

    def _call_block(self, block, x_BTM, segments, window, inv_freq_R, kv):
        def call(block, x_BTM):
            return block(x_BTM, segments, window=window, inv_freq_R=inv_freq_R, kv=kv)

        if self.cfg.remat != "none":
            # Only the block and the residual are arguments; everything else is closed over,
            # so a per-layer window (traced under the scan) needs no static handling.
            device = getattr(jax.typeof(x_BTM).sharding.mesh, "abstract_device", None)
            if device is not None:
                remat.check_platform(self.cfg.remat, device.platform)
            call = nnx.remat(call, policy=remat.policy(self.cfg.remat))
        return call(block, x_BTM)

    def _run_scanned(self, x_BTM, segments, windows, freqs_LR, cache, kv_ctx):
        caches = (cache.k, cache.v) if cache is not None else None
        return self._scan_stack(self.blocks, x_BTM, segments, windows, freqs_LR, caches, kv_ctx)

    def _scan_stack(self, blocks, x_BTM, segments, windows, freqs_LR, caches, kv_ctx):
        """`blocks` (stacked) run by `nnx.scan` over their layers' windows, rope tables and
        caches (`(k, v)` stacked on L, or None)."""
        uniform_window = len(set(windows)) == 1
        static_window = (windows[0] or None) if uniform_window else None
        windows_L = jnp.asarray(windows, jnp.int32)
        freqs_LR = jnp.asarray(freqs_LR)

        @nnx.scan(
            in_axes=(nnx.Carry, 0, 0, 0, 0),
            out_axes=(nnx.Carry, 0),
            transform_metadata={nnx.PARTITION_NAME: None},
            unroll=min(self._scan_unroll(), len(windows)),
        )
        def run(x, block, window, inv_freq_R, layer_kv):
            kv = None if layer_kv is None else LayerCache(*layer_kv, *kv_ctx)
            w = static_window if uniform_window else window
            x, (kv, layer_stats) = self._call_block(block, x, segments, w, inv_freq_R, kv)
            # Only keys and values are per layer; the rest is shared, not stacked over L.
            return x, ((None if kv is None else (kv.k, kv.v)), layer_stats)

        # Per layer: (kv cache, router stats), stacked on L by the scan.
        return run(x_BTM, self._compute_dtype_blocks(blocks), windows_L, freqs_LR, caches)

    def _compute_dtype_blocks(self, blocks=None):
        """The stacked blocks with their matmul weights cast to the compute dtype once, before
        the layer loop (as MaxText does), rather than per layer inside it: a cast inside the
        scan is a value the backward pass needs, so XLA wrote every layer's bf16 copy out as
        a stacked scan output beside the float32 stack. The values are the ones each Einsum
        would cast to itself (an astype of an astype is the same); norm scales and biases
        (1-D per layer) stay float32, as the norms compute in float32. The gradient flows back
        through the cast unchanged, so the float32 parameters and Adam see the same values."""
        dtype = self.cfg.compute_dtype
        blocks = self.blocks if blocks is None else blocks
        if jnp.dtype(dtype) == jnp.float32:
            return blocks
        graphdef, params, rest = nnx.split(blocks, nnx.Param, ...)
        # The matmul weights: 2+ dims per layer, so 3+ stacked [L, ...]. Unstacked layers
        # (a list) are cast here too: inside a rematerialised block each Einsum's own cast
        # runs again in the backward pass (llama3_1b compiled for H100: 0.4 GB per layer).
        matmul_ndim = 3 if self.cfg.scan_layers else 2
        return nnx.merge(graphdef, _to_compute_dtype(params, dtype, matmul_ndim), rest)

    def balance_routing(self, load_LE, rate: float):
        """A step-level update of the routers from each MoE layer's load `[L, E]` (shares
        summing to 1), outside the gradient; returns the routers' bias `[L, E]` after it, or
        None for routers without one (softmax routing: nothing to update)."""
        del load_LE, rate
        return None

    # -- the stage contract (zoo/layers/stage.py): what a pipeline schedule runs -----------

    def layer_stack(self, *, packed: bool = True, seq_len: int | None = None) -> Stack:
        """The stacked layers as a schedule runs them: one block on one micro-batch, its
        weights (the parameters, in their dtype, split over the stage axis), its window and
        rope table, the remat policy. `seq_len` (the rows' T) decides whether the attention
        backend runs a shard_map of its own (then the schedule's cannot check varying
        axes)."""
        cfg = self.cfg
        windows, freqs_LR = self._layer_tables()
        # The stack is the last `stacked_layers` layers (before them: `before_stack`'s).
        first = cfg.num_layers - cfg.stacked_layers
        windows, freqs_LR = windows[first:], freqs_LR[first:]
        uniform_window = len(set(windows)) == 1
        static_window = (windows[0] or None) if uniform_window else None
        graphdef, params, rest = nnx.split(self.blocks, nnx.Param, ...)

        def layer(w, x_BTM, rows: Rows, consts: LayerConsts):
            block = nnx.merge(graphdef, *w)
            seg = Segments.self_attention(rows.ids, rows.positions, packed=packed)
            window = static_window if uniform_window else consts.window
            with quant.unquantized_residuals():
                x_BTM, (_, router_stats) = block(
                    x_BTM, seg, window=window, inv_freq_R=consts.inv_freq, kv=None
                )
            return x_BTM if router_stats is None else (x_BTM, router_stats)

        def cast(w):
            params, rest = w
            return _to_compute_dtype(params, cfg.compute_dtype, 2), rest

        policy = None
        if cfg.remat != "none":
            device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
            if device is not None:
                remat.check_platform(cfg.remat, device.platform)
            policy = remat.policy(cfg.remat)
        consts = LayerConsts(np.asarray(windows, np.int32), np.asarray(freqs_LR))
        # An MoE layer's expert shard_map runs unchecked inside the schedule's (moe.py), so
        # the schedule's cannot check the cotangents it hands back either.
        check_vma = self._attention_keeps_layout(seq_len or cfg.max_seq_len) and not cfg.is_moe
        stats = zero_stats(cfg.num_experts) if cfg.is_moe else None
        return Stack(layer, cast, (params, rest), consts, policy, check_vma, stats)

    def _attention_keeps_layout(self, seq_len: int) -> bool:
        """Whether the attention backend this config runs keeps its layout (no shard_map of
        its own with the varying-axes check off); False too when it cannot tell."""
        cfg = self.cfg
        call = CallInfo(
            dtype=jnp.dtype(cfg.compute_dtype),
            head_dim=cfg.head_dim,
            q_len=seq_len,
            kv_len=seq_len,
            platform=compile_platform(),
            interpret=cfg.attention_interpret,
        )
        try:
            return backend(resolve_implementation(cfg.attention_impl, call)).keeps_layout
        except ValueError:
            return False

    def loss_head(self, *, chunk_size: int = 0, manual_axis: str | None = None) -> LossHead:
        """The final norm, the LM head and the next-token NLL summed over `rows.mask`, as a
        function of their parameters, for a schedule that runs them inside a shard_map manual
        over `manual_axis` (their row layouts then leave it out). `chunk_size` > 0 fuses the
        head with the loss over chunks (zoo/lm_head_loss.py)."""
        norm_def, norm_state = nnx.split(self.final_norm)
        head_w, _ = self._head()
        sharding = self.sharding
        _, head = self._head(out_spec=_without_axis(sharding.lm_head.out, manual_axis))
        norm_out = _without_axis(sharding.final_norm.out, manual_axis)

        def nll(params, y_BTM, rows: Rows):
            norm_state, head_w = params
            h_BTM = nnx.merge(norm_def, norm_state)(y_BTM, out_sharding=norm_out)
            with jax.named_scope("lm_head_loss"):
                if chunk_size:
                    nll_BT = chunked_token_nll(
                        h_BTM, head_w, rows.targets, rows.mask, head, chunk_size
                    )
                else:
                    logits = head.logits(h_BTM, head_w)
                    nll_BT = jnp.where(rows.mask, chunk_nll(logits, rows.targets), 0.0)
                return jnp.sum(nll_BT)

        return LossHead((norm_state, head_w), nll)

    def _scan_unroll(self) -> int:
        """Layers per scan iteration: the config's, or for 0 (auto) all of them when this
        trace compiles for CPU without remat (see DecoderConfig.scan_unroll), else 1."""
        cfg = self.cfg
        if cfg.scan_unroll:
            return min(cfg.scan_unroll, cfg.num_layers)
        cpu = compile_platform() == "cpu"
        return cfg.num_layers if cpu and cfg.remat == "none" else 1

    def _run_unscanned(self, x_BTM, segments, windows, freqs_LR, cache, kv_ctx):
        caches = (cache.k, cache.v) if cache is not None else None
        return self._loop_stack(self.blocks, x_BTM, segments, windows, freqs_LR, caches, kv_ctx)

    def _loop_stack(self, blocks, x_BTM, segments, windows, freqs_LR, caches, kv_ctx):
        """`blocks` (a list) run one after the other; `caches` as in `_scan_stack`."""
        ks, vs, stats = [], [], []
        for i, block in enumerate(self._compute_dtype_blocks(blocks)):
            kv = None if caches is None else LayerCache(caches[0][i], caches[1][i], *kv_ctx)
            x_BTM, (kv, layer_stats) = self._call_block(
                block, x_BTM, segments, windows[i] or None, freqs_LR[i], kv
            )
            if kv is not None:
                ks.append(kv.k)
                vs.append(kv.v)
            stats.append(layer_stats)
        new_kv = (jnp.stack(ks), jnp.stack(vs)) if caches is not None else None
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *stats) if self.cfg.is_moe else None
        return x_BTM, (new_kv, stacked)

    def _head(self, out_spec=None) -> tuple[jax.Array, Head]:
        """(weight, head): the float32 LM head `[M, V]` (or, tied, the embedding table
        `[V, M]`) and how it makes float32 logits, soft-capped if the family caps them, laid
        out as `out_spec` (None: the strategy's logits layout)."""
        cfg = self.cfg
        tied = self.lm_head is None
        weight = self.embed.table[...] if tied else self.lm_head.weight[...]
        head = Head(
            tied=tied,
            dtype=cfg.compute_dtype,
            out_spec=self.sharding.lm_head.out if out_spec is None else out_spec,
            softcap=cfg.final_logit_softcap,
            vocab_size=cfg.vocab_size,
        )
        return weight, head

    def logits(self, x_BTM):
        """float32 logits [B, T, V] of final-normed hidden states (`hidden`'s), the true
        vocabulary only: a caller that needs a few positions' logits (generation's last
        token) runs the LM head on those alone."""
        return drop_vocab_padding(self._logits(x_BTM), self.cfg.vocab_size)

    def _logits(self, x_BTM):
        """float32 logits over the table's rows, the padding columns (if any) masked."""
        with jax.named_scope("lm_head"):
            weight, head = self._head()
            return head.logits(x_BTM, weight)

    # -- generation ----------------------------------------------------------------------

    def init_cache(self, batch_size: int, max_len: int | None = None, dtype=None):
        """An empty KV cache: every slot has segment id 0, which no real query attends."""
        cfg = self.cfg
        S = max_len or cfg.max_seq_len
        dtype = dtype or cfg.compute_dtype
        kv_spec = jax.sharding.PartitionSpec(None, *self.sharding.block.attention.kv_cache)
        shape = (cfg.num_layers, batch_size, S, cfg.num_kv_heads, cfg.head_dim)
        tokens_spec = self.sharding.tokens
        return KVCache(
            k=jnp.zeros(shape, dtype, out_sharding=kv_spec),
            v=jnp.zeros(shape, dtype, out_sharding=kv_spec),
            segment_ids=jnp.zeros((batch_size, S), jnp.int32, out_sharding=tokens_spec),
            positions=jnp.zeros((batch_size, S), jnp.int32, out_sharding=tokens_spec),
            index=jnp.zeros((), jnp.int32),
        )


def _without_axis(spec, axis: str | None) -> P:
    """`spec` with `axis` taken out of its first (rows) entry: the layout inside a shard_map
    manual over `axis`."""
    if axis is None:
        return spec
    entries = list(tuple(spec))
    rest = tuple(a for a in axes_of(entries[0]) if a != axis)
    entries[0] = rest[0] if len(rest) == 1 else (rest or None)
    return P(*entries)
