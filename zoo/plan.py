"""A model planned once: (config, strategy, mesh) -> a checked `ModelPlan`.

Planning pads the vocabulary where its split needs it, builds the model once as shapes and
declared specs (on a mesh where every split divides, so nothing is allocated and nothing
fails yet), checks every parameter's and activation's split against the real mesh, and works
out the pipeline schedule. `create_model`, `abstract_model`, `from_pretrained` and the run
assembly (nnx_zoo/launch/build.py, which the planner compiles) all take the plan, so none of
them checks or builds the abstract model again.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import jax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_zoo.errors import UsageError
from shardings.mesh import check_divisible
from shardings.specs import split_size
from shardings.strategies import Strategy, get_strategy
from zoo.layers import pipeline
from zoo.layers.config import DecoderConfig
from zoo.registry import family_for_config

# Megatron's and MaxText's rule: a padded vocab is a multiple of 128 per vocab shard, so every
# shard's slice of the LM head is lane-aligned on TPU and a whole number of GPU tiles.
VOCAB_PAD_MULTIPLE = 128
_log = logging.getLogger(__name__)


def model_class(cfg: DecoderConfig):
    return family_for_config(cfg).model_cls


def _layout_model(cfg: DecoderConfig, strategy):
    """The model's parameter tree as shapes and declared specs, built on an abstract mesh
    whose strategy axes all have size 1 (every split then divides), so nothing is allocated.

    An abstract mesh, not `jax.set_mesh`: this also runs inside a trace (`nnx.eval_shape`
    of `create_model`), where only an abstract mesh of the same size may be entered, so the
    active mesh's devices go on one extra axis that no spec names.
    """
    active = jax.sharding.get_abstract_mesh()
    size = 1 if active is None or active.empty else active.size
    names = (*strategy.axes, "unnamed_devices")
    layout_mesh = jax.sharding.AbstractMesh(
        (1,) * len(strategy.axes) + (size,),
        names,
        axis_types=(jax.sharding.AxisType.Explicit,) * len(names),
    )
    cls = model_class(cfg)
    with jax.sharding.use_abstract_mesh(layout_mesh):
        return nnx.eval_shape(lambda: cls(cfg, strategy.lm_sharding(), rngs=nnx.Rngs(0)))


def _rows(layout) -> list[tuple[str, tuple[int, ...], object]]:
    rows = []
    for path, var in nnx.to_flat_state(nnx.state(layout, nnx.Param)):
        spec = var.get_metadata().get("out_sharding")
        rows.append(("/".join(str(p) for p in path), tuple(var.get_value().shape), spec))
    return rows


def param_layouts(cfg: DecoderConfig, strategy) -> list[tuple[str, tuple[int, ...], object]]:
    """(path, shape, declared spec) of every parameter, in tree order."""
    return _rows(_layout_model(cfg, strategy))


def activation_layouts(cfg: DecoderConfig, strategy) -> list[tuple[str, tuple[int, ...], object]]:
    """(name, shape, declared spec) of the activations whose split dims no parameter shows
    (a tied model has no LM head weight, so only the logits carry the vocab split)."""
    lm = strategy.lm_sharding()
    M, N, K, D, F, V = (
        cfg.hidden_dim,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.ffn_dim,
        cfg.vocab_rows,
    )
    # Batch and sequence are 1 here and unsplit: they are checked where the batch is made
    # (check_batch).
    no_batch = lambda spec: P(None, None, *tuple(spec)[2:])  # noqa: E731
    return [
        ("residual stream [B, T, M]", (1, 1, M), no_batch(lm.block.residual)),
        ("query heads [B, T, N, D]", (1, 1, N, D), no_batch(lm.block.attention.q.out)),
        ("kv heads [B, T, K, D]", (1, 1, K, D), no_batch(lm.block.attention.k.out)),
        ("mlp hidden [B, T, F]", (1, 1, F), no_batch(lm.block.mlp.up.out)),
        ("logits [B, T, V]", (1, 1, V), no_batch(lm.lm_head.out)),
    ]


def vocab_shards(strategy, mesh) -> int:
    """How many ways the strategy splits the vocab dim on `mesh`: of the logits, the LM head
    and the embedding table (their least common multiple; 1 when none is split)."""
    lm = strategy.lm_sharding()
    return math.lcm(
        split_size(lm.lm_head.out, 2, mesh.shape),
        split_size(lm.lm_head.weight, 1, mesh.shape),
        split_size(lm.embed.table, 0, mesh.shape),
    )


def fit_vocab(cfg: DecoderConfig, strategy, mesh) -> DecoderConfig:
    """`cfg` with the vocab padded where its rows do not divide the vocab split on `mesh`.

    Only then: a vocabulary that divides (Llama's 128256 over 8) keeps its exact size, and
    so do its checkpoints. A padded size already in `cfg` (a checkpoint's) that divides is
    kept. Else V rounds up to a multiple of 128 x the shards (GPT-2's 50257 over `model`=2:
    50432); the padded rows are never looked up and their logits are masked, so the numbers
    are those of the unpadded model. Checkpoints and Hugging Face files convert between
    paddings (nnx_zoo/checkpoint/restore.py, zoo/hf_io.py).
    """
    shards = vocab_shards(strategy, mesh)
    if cfg.vocab_rows % shards == 0:
        return cfg
    multiple = VOCAB_PAD_MULTIPLE * shards
    padded = -(-cfg.vocab_size // multiple) * multiple
    _log.info(
        "vocab_size=%d does not divide over the %d-way vocab split of %s: padded to %d rows "
        "(the %d extra logits are masked out of the loss and of generation)",
        cfg.vocab_size,
        shards,
        strategy.name,
        padded,
        padded - cfg.vocab_size,
    )
    return cfg.replace(padded_vocab_size=padded)


@dataclasses.dataclass(frozen=True, eq=False)
class ModelPlan:
    """A model config checked against a strategy and a mesh, with its shapes.

    Made by `plan_model` only. `cfg` is the config as the model is built (the vocab padded
    where the split needs it; `padded_vocab_size` then says so)."""

    cfg: DecoderConfig
    strategy: Strategy
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh
    pipeline: pipeline.PipelinePlan | None  # the schedule under a pipeline strategy, else None
    layout: nnx.Module  # the model as shapes and declared specs (`_layout_model`)

    @property
    def sharding(self):
        """The strategy's typed specs for every module (an LmSharding)."""
        return self.strategy.lm_sharding()

    @property
    def model_cls(self) -> type:
        return model_class(self.cfg)

    def param_layouts(self) -> list[tuple[str, tuple[int, ...], object]]:
        """(path, shape, declared spec) of every parameter, in tree order."""
        return _rows(self.layout)

    def check_batch_size(self, rows: int) -> None:
        """UsageError (one line) when `rows` per forward pass do not cut into the pipeline's
        micro-batches over the batch split (nothing to check without a pipeline)."""
        pipeline.check_batch_size(rows, self.pipeline, self.sharding, self.mesh)

    def abstract_model(self):
        """A fresh model whose every array is a `jax.ShapeDtypeStruct` in its declared layout
        on the plan's mesh: the plan's shapes placed, no model built again."""
        graphdef, state = nnx.split(self.layout)

        def place(x):
            return jax.ShapeDtypeStruct(
                x.shape, x.dtype, sharding=NamedSharding(self.mesh, x.sharding.spec)
            )

        return nnx.merge(graphdef, jax.tree.map(place, state))


def plan_model(cfg: DecoderConfig, strategy, mesh=None) -> ModelPlan:
    """Plan `cfg` under `strategy` (a Strategy or its name) on `mesh` (default: the active
    one, `jax.set_mesh`): pad the vocab where its split needs it, check that every split of
    every parameter and activation divides (UsageError, one line, naming the first that does
    not) and that the pipeline schedule fits. The one place a model is checked."""
    if isinstance(strategy, str):
        strategy = get_strategy(strategy)
    if mesh is None:
        mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        raise ValueError("a model needs a mesh: call it under `with jax.set_mesh(mesh):`")
    missing = [a for a in strategy.axes if a not in mesh.axis_names]
    if missing:
        raise UsageError(
            f"mesh axes {mesh.axis_names} lack {missing}, which strategy {strategy.name!r} uses"
        )
    if cfg.mtp_depth and strategy.lm_sharding().stage_axis is not None:
        raise UsageError(
            f"model.mtp_depth={cfg.mtp_depth}: multi-token prediction does not run under a "
            f"pipeline strategy ({strategy.name}: a schedule runs one layer stack); use one "
            "without `stage`, e.g. fsdp_ep, or model.mtp_depth=0"
        )
    cfg = fit_vocab(cfg, strategy, mesh)
    layout = _layout_model(cfg, strategy)
    check_divisible(_rows(layout), mesh, strategy.name)
    check_divisible(activation_layouts(cfg, strategy), mesh, strategy.name)
    schedule = pipeline.plan_for(cfg, strategy.lm_sharding(), mesh)
    return ModelPlan(cfg=cfg, strategy=strategy, mesh=mesh, pipeline=schedule, layout=layout)


def check_model_fits(cfg: DecoderConfig, strategy, mesh) -> None:
    """Raise UsageError naming the first array whose split does not divide its dim (the
    vocab, padded as the model will be, always does): `plan_model` without the plan."""
    plan_model(cfg, strategy, mesh)
