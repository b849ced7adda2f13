"""What a pipeline schedule needs from a model, and nothing more: the stage contract.

A model exports its layer stack as a `Stack` (one layer as a function of that layer's
weights, the stacked weights, per-layer constants, the remat policy) and its end as a
`LossHead` (the final norm, the LM head and the loss as a function of their parameters);
its embedding stays the model's own (the schedules take embedded rows). The schedules
(zoo/layers/pipeline.py: GPipe and circular; zoo/layers/pipeline_1f1b.py: 1F1B) take these
and a `PipelinePlan`, and know nothing else of the model: so they run as well on a toy stage
of a few lines of jnp (tests/test_pipeline_toy_stage.py) as on a decoder. The arrow points
one way: the schedules import this module, the model imports it, and the model imports no
schedule (zoo/pipelined.py, above both, picks the schedule).

`Rows` travel with each micro-batch from stage to stage: a layer reads the ids and positions
(attention's documents and rope), the loss the targets and the mask.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax


class Rows(NamedTuple):
    """Per-row data of `[B, T]` that travels with the activations (each field split over rows
    as the activations are). `targets` and `mask` only where the loss runs inside the
    schedule (1F1B); None elsewhere."""

    ids: jax.Array  # segment ids (0: padding)
    positions: jax.Array
    targets: jax.Array | None = None  # next-token targets
    mask: jax.Array | None = None  # which positions count in the loss


class Stack(NamedTuple):
    """The model's L stacked layers as a schedule runs them: one layer at a time, on one
    micro-batch, from that layer's slice of `weights`."""

    # layer(w, x, rows, consts) -> x (or (x, stats) where `stats` is given): one layer on one
    # micro-batch's `[b, ...]` activations, `w` being that layer's weights as `cast` returns
    # them, `consts` its row of `consts`.
    layer: Callable[[Any, jax.Array, Rows, Any], Any]
    # One layer's weights (a slice of `weights`) -> what `layer` computes with (the model's
    # compute dtype for its matmul weights). Applied per layer inside the layer's remat, so
    # the schedules keep the weights and their gradient sums in the parameters' dtype.
    cast: Callable[[Any], Any]
    weights: Any  # pytree of `[L, ...]` arrays, split on L over the stage axis
    consts: Any  # pytree of `[L, ...]` numpy arrays: per-layer constants (windows, rope)
    # The remat policy each layer runs under, or None for "save everything" (the schedule
    # then saves everything but the layer's weight slice, which it re-slices instead).
    policy: Any
    # False where a layer opens a shard_map of its own with the varying-axes check off
    # (attention kernels that are black boxes to sharding types: splash, cuDNN); a checked
    # shard_map around it then refuses their transposes' cotangents.
    check_vma: bool = True
    # One layer's statistics as zeros (a pytree of float32 arrays: an MoE layer's routing
    # sums), or None (the layer returns x alone). A schedule sums each layer's over the
    # micro-batches (bubbles excluded) and returns them stacked on L in layer order: so they
    # must be sums, whose total over micro-batches is the whole batch's.
    stats: Any = None


class LossHead(NamedTuple):
    """The model's end as a function of its parameters, for a schedule that runs the loss
    inside its loop (1F1B)."""

    params: Any  # pytree of arrays replicated over the stage axis (final norm, LM head)
    # loss(params, y, rows) -> float32 scalar: the loss summed over `rows.mask` of one
    # micro-batch's last-layer activations `y`, inside the schedule's shard_map (manual over
    # the stage axis, so its layouts leave that axis out of the rows).
    loss: Callable[[Any, jax.Array, Rows], jax.Array]


# Who runs a pipeline-layout model's stack when its caller names no schedule (a plain
# `model(...)`): zoo/pipelined.py registers its forward schedule here when imported, so the
# model asks the contract, not a schedule module, and imports none.
_DEFAULT_RUNNER: list[Callable[[Any], Any]] = []


def register_default_runner(runner: Callable[[Any], Any]) -> None:
    """`runner(model) -> layers(x_BTM, segments) | None`, for models under a stage axis."""
    _DEFAULT_RUNNER[:] = [runner]


def default_layers(model):
    """The registered runner's `layers` for `model`, or None (the model's own loop)."""
    return _DEFAULT_RUNNER[0](model) if _DEFAULT_RUNNER else None
