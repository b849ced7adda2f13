"""DeepSeek-V3's mixture of experts: sigmoid router scores, group-limited top-k chosen with the
auxiliary-loss-free correction bias, and shared experts beside the routed ones.

The routed experts, their token exchange (zoo/layers/moe_exchange.py: ragged or padded under
`fsdp_ep` / `fsdp_tp_ep`) and the statistics are `Moe`'s; only the routing differs, as
transformers' `DeepseekV3TopkRouter` computes it:

- scores s = sigmoid(x . W_router), in float32;
- the choice adds the correction bias b (one per expert): the experts are split into
  `moe_groups` groups, each group scored by the sum of its top 2 of s + b, the best
  `moe_groups_per_tok` groups kept, and the top k of s + b among their experts chosen;
- the mixing weights are the chosen experts' s (not s + b: the bias steers selection only),
  renormalised to sum to 1 when `norm_topk_prob`, times `routed_scaling_factor`.

The bias is DeepSeek's auxiliary-loss-free balancing (arXiv 2412.19437, section 2.1.2): no
gradient reaches it (it only picks indices; the stop_gradient makes that explicit). It is an
`nnx.Param` so that checkpoints and Hugging Face files carry it, and AdamW leaves it exactly
as it is: a zero gradient moves no Adam moment, and a path containing 'bias' is never
decayed (nnx_zoo/training/optim.py).

The shared experts are one dense SwiGLU of width `num_shared_experts * moe_ffn_dim` that
every token goes through, laid out as the dense MLP is.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from nnx_zoo.errors import UsageError
from shardings.specs import MlpSharding, MoeSharding
from zoo.layers.basic import Einsum
from zoo.layers.mlp import Mlp
from zoo.layers.moe import Moe


def grouped_route(scores_BTE, bias_E, k: int, groups: int, groups_per_tok: int):
    """experts_BTk: the top k of scores + bias among the experts of the best `groups_per_tok`
    of `groups` groups, a group scored by the sum of its top 2 of scores + bias."""
    B, T, E = scores_BTE.shape
    choice_BTE = scores_BTE + bias_E
    grouped_BTGe = choice_BTE.reshape(B, T, groups, E // groups)
    group_BTG = jnp.sum(jax.lax.top_k(grouped_BTGe, min(2, E // groups))[0], axis=-1)
    _, top_groups_BTg = jax.lax.top_k(group_BTG, groups_per_tok)
    kept_BTG = jnp.sum(jax.nn.one_hot(top_groups_BTg, groups, dtype=jnp.float32), axis=-2) > 0
    kept_BTE = jnp.repeat(kept_BTG, E // groups, axis=-1)
    choice_BTE = jnp.where(kept_BTE, choice_BTE, -jnp.inf)
    return jax.lax.top_k(choice_BTE, k)[1]


class GroupedMoe(Moe):
    def __init__(self, cfg, sharding: MoeSharding, shared: MlpSharding, *, rngs: nnx.Rngs):
        super().__init__(cfg, sharding, rngs=rngs)
        E = cfg.num_experts
        if E % cfg.moe_groups or not 0 < cfg.moe_groups_per_tok <= cfg.moe_groups:
            raise UsageError(
                f"num_experts={E}, moe_groups={cfg.moe_groups}, moe_groups_per_tok="
                f"{cfg.moe_groups_per_tok}: the groups must divide the experts, and 1 <= "
                "groups per token <= groups"
            )
        if cfg.num_experts_per_tok > cfg.moe_groups_per_tok * (E // cfg.moe_groups):
            raise UsageError(
                f"num_experts_per_tok={cfg.num_experts_per_tok} exceeds the experts of "
                f"moe_groups_per_tok={cfg.moe_groups_per_tok} groups of {E // cfg.moe_groups}"
            )
        self.groups = cfg.moe_groups
        self.groups_per_tok = cfg.moe_groups_per_tok
        self.scaling = cfg.routed_scaling_factor
        # transformers keeps the router in float32 (`_keep_in_fp32_modules_strict`) and
        # computes its logits in float32 whatever the model's dtype.
        M = cfg.hidden_dim
        self.router = Einsum("BTM,ME->BTE", (M, E), sharding.router, rngs=rngs, dtype=jnp.float32)
        self.e_score_correction_bias = nnx.Param(
            jnp.zeros((E,), jnp.float32, out_sharding=P(None)), out_sharding=P(None)
        )
        F_shared = cfg.num_shared_experts * cfg.moe_ffn_dim
        self.shared = Mlp(cfg.replace(ffn_dim=F_shared), shared, rngs=rngs) if F_shared else None

    def route(self, x_BTM):
        scores_BTE = jax.nn.sigmoid(self.router(x_BTM))
        bias_E = jax.lax.stop_gradient(self.e_score_correction_bias[...])
        experts_BTk = grouped_route(scores_BTE, bias_E, self.k, self.groups, self.groups_per_tok)
        weights_BTk = jnp.take_along_axis(scores_BTE, experts_BTk, axis=-1)
        if self.norm_topk_prob:
            weights_BTk = weights_BTk / (jnp.sum(weights_BTk, axis=-1, keepdims=True) + 1e-20)
        # For the statistics (the load-balancing loss's probabilities: a weight of 0 by
        # default), each token's scores normalised to sum to 1, as DeepSeek-V3's
        # sequence-wise balance loss normalises them.
        probs_BTE = scores_BTE / jnp.sum(scores_BTE, axis=-1, keepdims=True)
        return weights_BTk * self.scaling, experts_BTk, probs_BTE

    def __call__(self, x_BTM, mask_BT):
        y_BTM, stats = super().__call__(x_BTM, mask_BT)
        if self.shared is not None:
            y_BTM = y_BTM + self.shared(x_BTM)
        return y_BTM, stats
