"""An MoE model's load-balancing loss added to a training objective, with its metrics: the
one rule the next-token loss (training/loop.py) and the preference objectives
(training/preference.py) share."""

from __future__ import annotations

import jax.numpy as jnp


def objective_from_sums(total, count, moe, aux_coef: float):
    """(the objective summed over `count` units, (`count`, metric sums)) from a loss summed
    over `count` units (counted tokens; pairs for a preference objective). The aux loss is
    added once per unit, so that dividing by the count gives transformers' (and TRL's)
    `loss + coef * aux_loss`; the sums carry the aux loss and the per-expert load (mean over
    layers), each times the count. `moe`: the model's routing statistics, None for a dense
    model (then `total` unchanged and no sums).
    """
    sums = {}
    if moe is not None:
        total = total + aux_coef * moe.aux_loss * count
        # Load-balance spread: the busiest expert's share over the mean share, worst layer
        # (1 is balanced; the busiest expert shard's work and received rows scale with it).
        spread = jnp.max(jnp.max(moe.load, axis=1) * moe.load.shape[1])
        sums = {
            "aux_loss": moe.aux_loss * count,
            "expert_load": jnp.mean(moe.load, 0) * count,
            "moe_load_spread": spread * count,
            "moe_dropped": moe.dropped * count,  # share of assignments dropped (0: dropless)
            # [L, E]: each MoE layer's load, for the routers' step-level bias update
            # (DecoderLM.balance_routing; the train step takes it out of the metrics).
            "moe_layer_load": moe.load * count,
        }
    return total, (count, sums)
