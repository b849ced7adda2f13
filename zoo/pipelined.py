"""A model under a pipeline strategy: the one place that picks the schedule its layer stack
runs, from the `PipelinePlan` the model was planned with (`ModelPlan.pipeline`, zoo/plan.py).

The model knows no schedule, and the schedules know no model: the model exports its layer
stack and its end (zoo/layers/stage.py), and this module hands them to GPipe / circular
(zoo/layers/pipeline.py) or 1F1B (zoo/layers/pipeline_1f1b.py). With `pp` None every
function here is the model's own method.

A plain `model(...)` under a pipeline strategy runs the forward schedule too: this module
registers it with the contract (zoo/layers/stage.py's default runner), which the model asks,
so the model imports no schedule.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from zoo import loss
from zoo.layers import pipeline, pipeline_1f1b, stage
from zoo.layers.decoder import LmOutput, NllSum, TokenNll
from zoo.layers.moe import moe_stats
from zoo.layers.pipeline import PipelinePlan
from zoo.layers.stage import Rows


def layers(model, pp: PipelinePlan | None):
    """`layers(x_BTM, segments) -> (x_BTM, per-layer statistics or None)` for the model's
    `hidden`: the forward schedule (GPipe / circular; 1F1B's forward is GPipe's loop) over
    the strategy's stage axis, or None (the model's own loop) without a pipeline."""
    if pp is None:
        return None
    stage_axis = model.sharding.stage_axis

    def run(x_BTM, segments):
        stack = model.layer_stack(packed=segments.packed, seq_len=x_BTM.shape[1])
        rows = Rows(segments.q_ids_BT, segments.q_positions_BT)
        return pipeline.run_stack(stack, pp, stage_axis, x_BTM, rows)

    return run


def forward(model, pp: PipelinePlan | None, tokens_BT, *, segment_ids, positions, packed=True):
    """The model's `forward` (no cache) with its layer stack run by `pp`'s schedule."""
    return model.forward(
        tokens_BT,
        segment_ids=segment_ids,
        positions=positions,
        packed=packed,
        layers=layers(model, pp),
    )


def logits(model, pp: PipelinePlan | None, tokens_BT, *, segment_ids, positions, packed=True):
    """float32 logits `[B, T, V]`, as `model(...)`, the layer stack run by `pp`'s schedule."""
    out: LmOutput = forward(
        model, pp, tokens_BT, segment_ids=segment_ids, positions=positions, packed=packed
    )
    return out.logits_BTV


def token_nll(
    model,
    pp: PipelinePlan | None,
    tokens_BT,
    *,
    segment_ids,
    positions,
    chunk_size: int = 0,
    packed=True,
) -> TokenNll:
    """The model's `token_nll` with its layer stack run by `pp`'s schedule."""
    return model.token_nll(
        tokens_BT,
        segment_ids=segment_ids,
        positions=positions,
        chunk_size=chunk_size,
        packed=packed,
        layers=layers(model, pp),
    )


def nll_sum(
    model,
    pp: PipelinePlan | None,
    tokens_BT,
    *,
    segment_ids,
    positions,
    loss_mask_BT=None,
    chunk_size: int = 0,
    packed=True,
) -> NllSum:
    """The model's `nll_sum` with its layer stack run by `pp`'s schedule. Under 1F1B the sum
    comes from the pipeline itself, which runs the final norm, the LM head and the loss
    inside its loop and computes the gradient as it goes."""
    if pp is None or pp.schedule != "1f1b":
        return model.nll_sum(
            tokens_BT,
            segment_ids=segment_ids,
            positions=positions,
            loss_mask_BT=loss_mask_BT,
            chunk_size=chunk_size,
            packed=packed,
            layers=layers(model, pp),
        )
    targets_BT, mask_BT = loss.target_mask(tokens_BT, segment_ids)
    if loss_mask_BT is not None:
        mask_BT = loss.answer_mask(mask_BT, loss_mask_BT)
    stage_axis = model.sharding.stage_axis
    total, stats = pipeline_1f1b.nll_sum(
        model.layer_stack(packed=packed, seq_len=tokens_BT.shape[1]),
        model.loss_head(chunk_size=chunk_size, manual_axis=stage_axis),
        pp,
        stage_axis,
        model.stage_input(tokens_BT, segment_ids=segment_ids, positions=positions, packed=packed),
        Rows(segment_ids, positions, targets_BT, mask_BT),
    )
    stats = None if stats is None else moe_stats(stats, model.cfg.num_experts)
    return NllSum(total, jnp.sum(mask_BT), stats)


def _plain_call_layers(model):
    """A plain `model(...)` under a pipeline strategy runs the forward schedule of the plan
    its layout gives on the current mesh (zoo/layers/stage.py's default runner)."""
    mesh = jax.sharding.get_abstract_mesh()
    return layers(model, pipeline.plan_for(model.cfg, model.sharding, mesh))


stage.register_default_runner(_plain_call_layers)
