"""A planned model (zoo/plan.py) -> the model, concrete or as shapes.

Each function takes a `ModelPlan`, or the (config, strategy[, mesh]) to plan once through
`plan_model`: `create_model(get_config("tiny"), strategy, rngs=...)` keeps working.
"""

from __future__ import annotations

from flax import nnx

from zoo.layers.config import DecoderConfig
from zoo.plan import (
    ModelPlan,
    activation_layouts,
    check_model_fits,
    fit_vocab,
    model_class,
    param_layouts,
    plan_model,
    vocab_shards,
)
from zoo.registry import get_config

__all__ = [
    "ModelPlan",
    "abstract_model",
    "activation_layouts",
    "as_plan",
    "check_model_fits",
    "create_model",
    "fit_vocab",
    "get_config",
    "model_class",
    "param_layouts",
    "plan_model",
    "vocab_shards",
]


def as_plan(cfg: DecoderConfig | ModelPlan, strategy=None, mesh=None) -> ModelPlan:
    """`cfg` itself when it is a plan (then `strategy` and `mesh` must be left out), else
    `plan_model(cfg, strategy, mesh)`."""
    if isinstance(cfg, ModelPlan):
        if strategy is not None or mesh is not None:
            raise TypeError("a ModelPlan already holds its strategy and mesh; pass the plan alone")
        return cfg
    if strategy is None:
        raise TypeError("a model config needs a strategy (a Strategy or its name)")
    return plan_model(cfg, strategy, mesh)


def abstract_model(cfg: DecoderConfig | ModelPlan, strategy=None, mesh=None):
    """The model as shapes in the strategy's layout on the mesh, nothing allocated: the vocab
    padded where its split needs it (the model's `cfg` then says so) and every split checked.
    For filling from files (a checkpoint, Hugging Face tensors) straight into the layout, so
    the model is never initialised nor held twice."""
    return as_plan(cfg, strategy, mesh).abstract_model()


def create_model(
    cfg: DecoderConfig | ModelPlan, strategy=None, *, rngs: nnx.Rngs, mesh=None
) -> nnx.Module:
    """Build the model for the active mesh (`jax.set_mesh`) or `mesh` (or the plan's).

    Parameters are created inside one jit, each directly with its layout, so no device ever
    holds a full copy of the model. A vocab that does not divide its split is padded: the
    model's `cfg` then differs from `cfg` in `padded_vocab_size`.
    """
    plan = as_plan(cfg, strategy, mesh)
    cls, planned, sharding = plan.model_cls, plan.cfg, plan.sharding
    return nnx.jit(lambda r: cls(planned, sharding, rngs=r))(rngs)
