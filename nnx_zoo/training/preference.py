"""Preference objectives on packed pairs: DPO (sigmoid, optional label smoothing), ORPO and
SimPO, with the metrics TRL logs.

A batch of pairs (nnx_zoo/data/preference.py) holds each pair in one row, its chosen
sequence as segment 2k-1 and its rejected one as segment 2k, `loss_mask` on the answer
tokens. A sequence's log probability is the sum, over its answer tokens, of the model's
log probability of that token given what precedes it (TRL's `logps`): a segment-wise
cumulative sum along each row, read at the pair's last token, so a pair's numbers sit at
one position of `[B, T]` and everything stays in the batch's layout (no gather, no
per-pair array whose size depends on the data).

Each objective returns, like the SFT loss, (a sum over pairs, (the pair count, metric
sums)): sums add over micro-batches and devices before the one division by the count, so
the loss is the mean over the batch's pairs (TRL's `.mean()` over the pairs of a batch),
and each metric is its mean over pairs.

  dpo    -(1-eps) log sigmoid(z) - eps log sigmoid(-z), z = beta ((pc - rc) - (pr - rr)):
         p the policy's summed logps, r the reference's; rewards beta (p - r).
  simpo  the same with z = beta (pc/nc - pr/nr) - gamma: length-normalized logps (n answer
         tokens), no reference; rewards beta p/n. TRL: CPOTrainer(loss_type='simpo',
         cpo_alpha=0).
  orpo   NLL of the chosen sequences (prompt and answer, token mean) - lambda mean
         log sigmoid(log odds(pc/nc) - log odds(pr/nr)); rewards lambda p/n. With
         micro-batches the NLL's token mean is per micro-batch (as TRL's gradient
         accumulation computes it).

The reference (DPO): with LoRA, the model itself with its adapters zeroed (the base:
one set of weights); without LoRA, a frozen copy of the starting weights, laid out like
the policy, which the step takes as an argument (so a plan counts its bytes).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from nnx_zoo.training.router_loss import objective_from_sums
from zoo import loss, pipelined
from zoo.layers.lora import LoraParam, has_lora

OBJECTIVES = ("dpo", "orpo", "simpo")
# What every objective logs per pair (TRL's names), means over the batch's pairs.
METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
)


@dataclasses.dataclass(frozen=True)
class Objective:
    name: str
    dpo_beta: float = 0.1
    dpo_label_smoothing: float = 0.0
    orpo_beta: float = 0.1
    simpo_beta: float = 2.0
    simpo_gamma: float = 1.0

    @classmethod
    def from_training(cls, training) -> Objective | None:
        """The run's preference objective (config `training`); None for sft."""
        if training.objective not in OBJECTIVES:
            return None
        names = [f.name for f in dataclasses.fields(cls) if f.name != "name"]
        return cls(training.objective, **{n: getattr(training, n) for n in names})

    @property
    def needs_reference(self) -> bool:
        return self.name == "dpo"


class PairLogps(NamedTuple):
    """Per pair, at the pair's last position of `[B, T]` (`end_BT`); elsewhere meaningless."""

    chosen_BT: jax.Array  # summed log probability of the chosen answer's tokens
    rejected_BT: jax.Array
    chosen_tokens_BT: jax.Array  # answer tokens counted
    rejected_tokens_BT: jax.Array
    chosen_nll_BT: jax.Array  # NLL summed over the whole chosen sequence (ORPO)
    chosen_all_tokens_BT: jax.Array  # its counted positions
    end_BT: jax.Array  # bool: the pair's last token


def _whole_rows(x_BT, like_BT=None):
    """`x_BT` with T unsplit (context parallelism splits it): the scans run along T. Given
    `like_BT`, laid out as that (the batch's ids as the model's per-token outputs)."""
    sharding = jax.typeof(x_BT if like_BT is None else like_BT).sharding
    if sharding.mesh.empty:
        return x_BT
    spec = P((tuple(sharding.spec) + (None,))[0], None)
    return x_BT if jax.typeof(x_BT).sharding.spec == spec else jax.sharding.reshard(x_BT, spec)


def _shift(x_BT, by: int, fill):
    """x[:, t - by] (by=1: previous) or x[:, t + 1] (by=-1), `fill` where off the row."""
    if by == 1:
        return jnp.concatenate([jnp.full_like(x_BT[:, :1], fill), x_BT[:, :-1]], axis=1)
    return jnp.concatenate([x_BT[:, 1:], jnp.full_like(x_BT[:, :1], fill)], axis=1)


def _segment_cumsum(x_BT, start_BT):
    """Cumulative sum along T restarting at every `start_BT` position."""

    def combine(a, b):
        (start_a, sum_a), (start_b, sum_b) = a, b
        return start_a | start_b, jnp.where(start_b, sum_b, sum_a + sum_b)

    return jax.lax.associative_scan(combine, (start_BT, x_BT), axis=1)[1]


def pair_logps(nll_BT, mask_BT, batch) -> PairLogps:
    """A batch's per-pair sums from the per-token NLL and which positions count
    (`zoo.loss.target_mask`'s mask: a sequence's own next token)."""
    nll_BT, mask_BT = _whole_rows(nll_BT), _whole_rows(mask_BT)
    segments_BT = _whole_rows(batch["segment_ids"], nll_BT)
    answer_BT = loss.answer_mask(mask_BT, _whole_rows(batch["loss_mask"], nll_BT))
    pair_BT = (segments_BT + 1) // 2
    chosen_BT = (segments_BT % 2) == 1
    start_BT = pair_BT != _shift(pair_BT, 1, -1)
    end_BT = (pair_BT != 0) & (pair_BT != _shift(pair_BT, -1, -1))
    logp_BT = jnp.where(answer_BT, -nll_BT, 0.0)
    counted_BT = answer_BT.astype(jnp.float32)

    def per_pair(x_BT, side_BT):
        return _segment_cumsum(jnp.where(side_BT, x_BT, 0.0), start_BT)

    rejected_BT = ~chosen_BT
    return PairLogps(
        chosen_BT=per_pair(logp_BT, chosen_BT),
        rejected_BT=per_pair(logp_BT, rejected_BT),
        chosen_tokens_BT=per_pair(counted_BT, chosen_BT),
        rejected_tokens_BT=per_pair(counted_BT, rejected_BT),
        chosen_nll_BT=per_pair(jnp.where(mask_BT, nll_BT, 0.0), chosen_BT),
        chosen_all_tokens_BT=per_pair(mask_BT.astype(jnp.float32), chosen_BT),
        end_BT=end_BT,
    )


def model_pair_logps(model, batch, *, packed: bool, chunk_size: int, pipeline=None):
    """(`pair_logps` of `model` on `batch` (under a pipeline strategy, its schedule), the
    model's MoE routing statistics or None for a dense model)."""
    nll_BT, mask_BT, router_stats = pipelined.token_nll(
        model,
        pipeline,
        batch["tokens"],
        segment_ids=batch["segment_ids"],
        positions=batch["positions"],
        chunk_size=chunk_size,
        packed=packed,
    )
    return pair_logps(nll_BT, mask_BT, batch), router_stats


def _log1mexp(x):
    """log(1 - exp(x)) for x < 0, stable on both sides of -log 2 (TRL's `log1mexp`)."""
    t = -math.log(2.0)
    low = jnp.minimum(x, t)
    high = jnp.maximum(x, t)
    return jnp.where(x < t, jnp.log1p(-jnp.exp(low)), jnp.log(-jnp.expm1(high)))


def _sigmoid_loss(z, smoothing: float):
    return -(1.0 - smoothing) * jax.nn.log_sigmoid(z) - smoothing * jax.nn.log_sigmoid(-z)


def objective_sums(objective: Objective, policy: PairLogps, reference: PairLogps | None):
    """(the loss summed over pairs, (the pair count, metric sums over pairs))."""
    end = policy.end_BT
    count = jnp.sum(end)
    pc, pr = policy.chosen_BT, policy.rejected_BT
    nc = jnp.maximum(policy.chosen_tokens_BT, 1.0)
    nr = jnp.maximum(policy.rejected_tokens_BT, 1.0)
    extra = {}
    if objective.name == "dpo":
        beta = objective.dpo_beta
        rc, rr = (jax.lax.stop_gradient(x) for x in (reference.chosen_BT, reference.rejected_BT))
        z = beta * ((pc - rc) - (pr - rr))
        losses = _sigmoid_loss(z, objective.dpo_label_smoothing)
        reward_c, reward_r, logp_c, logp_r = beta * (pc - rc), beta * (pr - rr), pc, pr
        total = jnp.sum(jnp.where(end, losses, 0.0))
    elif objective.name == "simpo":
        beta = objective.simpo_beta
        logp_c, logp_r = pc / nc, pr / nr
        z = beta * (logp_c - logp_r) - objective.simpo_gamma
        losses = _sigmoid_loss(z, 0.0)
        reward_c, reward_r = beta * logp_c, beta * logp_r
        total = jnp.sum(jnp.where(end, losses, 0.0))
    else:  # orpo
        beta = objective.orpo_beta
        logp_c, logp_r = pc / nc, pr / nr
        log_odds = (logp_c - logp_r) - (_log1mexp(logp_c) - _log1mexp(logp_r))
        ratio = jax.nn.log_sigmoid(log_odds)
        nll_tokens = jnp.maximum(jnp.sum(jnp.where(end, policy.chosen_all_tokens_BT, 0.0)), 1.0)
        nll = jnp.sum(jnp.where(end, policy.chosen_nll_BT, 0.0)) / nll_tokens
        # The NLL's token mean, counted once per pair so that dividing by the count gives
        # TRL's `nll - mean(beta * ratio)`.
        total = jnp.sum(jnp.where(end, -beta * ratio, 0.0)) + nll * count
        reward_c, reward_r = beta * logp_c, beta * logp_r
        extra = {
            "nll_loss": nll * count,
            "log_odds_ratio": jnp.sum(jnp.where(end, ratio, 0.0)),
            "log_odds_chosen": jnp.sum(jnp.where(end, log_odds, 0.0)),
        }
    per_pair = {
        "rewards/chosen": reward_c,
        "rewards/rejected": reward_r,
        "rewards/margins": reward_c - reward_r,
        "rewards/accuracies": (reward_c > reward_r).astype(jnp.float32),
        "logps/chosen": logp_c,
        "logps/rejected": logp_r,
    }
    sums = {k: jnp.sum(jnp.where(end, jax.lax.stop_gradient(v), 0.0)) for k, v in per_pair.items()}
    sums.update({k: jax.lax.stop_gradient(v) for k, v in extra.items()})
    return total, (count, sums)


# ----------------------------------------------------------------------------- reference


def frozen_copy(model):
    """(graphdef, state) of a copy of `model`'s current state, for DPO without LoRA (None
    with LoRA: the reference is then the model with its adapters zeroed). Abstract states
    (ShapeDtypeStructs: a plan) are kept as shapes."""
    if has_lora(model):
        return None
    graphdef, state = nnx.split(model)

    def copy(x):
        return x if isinstance(x, jax.ShapeDtypeStruct) else jnp.copy(x)

    return graphdef, jax.tree.map(copy, state)


def without_adapters(model):
    """`model` with every LoRA adapter's weights zero: the base's outputs, from the same
    base weights (no copy)."""
    graphdef, adapters, rest = nnx.split(model, LoraParam, ...)
    return nnx.merge(graphdef, jax.tree.map(jnp.zeros_like, adapters), rest)


def _rebuilt(graphdef, state):
    """The reference module made here from the state's arrays: its variables then belong
    to this trace level (a micro-batch loop's body, the gradient's function), which the
    model's layer scan requires of every variable it sees."""
    leaves, treedef = jax.tree.flatten(state)
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))


def loss_sum(
    objective: Objective,
    model,
    batch,
    packed: bool = True,
    chunk_size: int = 0,
    pipeline=None,
    reference=None,
    router_aux: bool = True,
):
    """`objective_sums` of `model` on `batch`: what the step differentiates. `reference`:
    `frozen_copy`'s (graphdef, state), or None (LoRA: the adapters zeroed).

    An MoE policy's load-balancing loss, times the config's `router_aux_loss_coef`, is
    added to the mean over pairs and logged as `aux_loss` (with the router's load), as the
    next-token loss does and as TRL's DPOTrainer / CPOTrainer / ORPOTrainer add their
    policy forward's `aux_loss`; the reference's routing is not a training signal.
    `router_aux=False` leaves it out (validation: the objective alone, as SFT's val_loss).
    """
    kw = dict(packed=packed, chunk_size=chunk_size, pipeline=pipeline)
    policy, router_stats = model_pair_logps(model, batch, **kw)
    ref = None
    if objective.needs_reference:
        ref_model = without_adapters(model) if reference is None else _rebuilt(*reference)
        ref_model = nnx.view(ref_model, deterministic=True, raise_if_not_found=False)
        ref = jax.tree.map(jax.lax.stop_gradient, model_pair_logps(ref_model, batch, **kw)[0])
    total, (count, sums) = objective_sums(objective, policy, ref)
    if router_stats is None or not router_aux:
        return total, (count, sums)
    coef = model.cfg.router_aux_loss_coef
    total, (count, moe_sums) = objective_from_sums(total, count, router_stats, coef)
    return total, (count, {**sums, **moe_sums})
