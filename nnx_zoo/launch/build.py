"""One assembly of a run: run config -> mesh -> model -> optimizer -> train step -> run info.

train_main, eval_main, plan_main and the benches all build here, concrete or abstract, so
the step the planner compiles is the step train_main runs (same loss chunking, remat,
micro-batches, optimizer) and its memory figures come from one formula
(`training.step_memory`). Abstract means shapes only: every array a `jax.ShapeDtypeStruct`
with its `NamedSharding` on the mesh, so a model far larger than this host, on a TPU or GPU
target it does not have, is compiled without allocating anything.

Every mistake in the inputs surfaces here as a one-line UsageError,
which the entry points turn into exit status 2.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable

import jax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_zoo.errors import UsageError
from nnx_zoo.training import finetune, optim, preference
from nnx_zoo.training.config import ModelSection, RunConfig
from nnx_zoo.training.loop import Trainer
from nnx_zoo.training.step_memory import abstract_batch
from shardings import Strategy, check_batch, get_strategy
from shardings.hybrid import crossing_axes
from zoo import create_model, from_pretrained
from zoo.hf_io import read_config
from zoo.layers import remat
from zoo.layers.attention import check_implementation
from zoo.plan import ModelPlan, plan_model


@dataclasses.dataclass
class Run:
    """A built run: what a training step needs, concrete or abstract."""

    config: RunConfig
    plan: ModelPlan  # the model's config, strategy, mesh and pipeline schedule, checked
    model: nnx.Module
    optimizer: nnx.Optimizer
    trainer: Trainer
    schedule: Callable[[int], float]  # step -> learning rate
    abstract: bool
    init_from: str | None = None

    @property
    def strategy(self):
        return self.plan.strategy

    @property
    def mesh(self) -> jax.sharding.Mesh:
        return self.plan.mesh

    @property
    def model_cfg(self):
        """The zoo config as built: vocab padded for the mesh; with init_from, the
        checkpoint's architecture."""
        return self.plan.cfg

    @property
    def batch_spec(self) -> P:
        return self.strategy.batch_spec()

    def abstract_batch(self) -> dict[str, jax.ShapeDtypeStruct]:
        """One step's global batch as shapes in the batch layout."""
        data = self.config.data
        batch = abstract_batch(self.mesh, self.batch_spec, data.global_batch_size, data.seq_len)
        if data.format != "text":  # records' batches carry which tokens are answers
            batch["loss_mask"] = batch["tokens"]
        return batch

    def compile(self):
        """(compiled train step, seconds): lowered on the run's state and a batch of the
        run's shape, which is what train_main's first real batch looks like too."""
        start = time.perf_counter()
        with jax.set_mesh(self.mesh):
            compiled = self.trainer.lower(self.abstract_batch()).compile()
        return compiled, time.perf_counter() - start

    def info(self) -> dict:
        """run_info.json's record of the run (the compiled step's `memory` is added by the
        caller that compiled it)."""
        cfg = self.model_cfg
        return {
            "config": self.config.to_dict(),
            "strategy": self.strategy.name,
            "mesh_shape": dict(self.mesh.shape),
            "num_devices": self.mesh.size,
            "num_processes": jax.process_count(),
            # Axes whose collectives leave a slice (or process): the slow links (DCN).
            "slice_crossing_axes": list(crossing_axes(self.mesh)),
            "model": cfg.describe(),
            # The architecture actually trained (with --init_from it is the checkpoint's, not
            # the config's preset); eval_main.py rebuilds the model from it.
            "model_config": {"type": type(cfg).__name__, **dataclasses.asdict(cfg)},
            "init_from": self.init_from,
        }


def run_strategy(run: RunConfig) -> Strategy:
    """The run's strategy: the one place its name becomes a Strategy (one line when unknown)."""
    return get_strategy(run.training.sharding_strategy)


def run_devices(run: RunConfig) -> list:
    """The devices the run uses: every device, or the first `training.num_devices` of them
    (one process only: with several, every process's devices take part in the mesh)."""
    wanted, devices = run.training.num_devices, jax.devices()
    if not wanted:
        return devices
    if jax.process_count() > 1:
        raise UsageError(
            f"training.num_devices={wanted} is for one process; with "
            f"{jax.process_count()} processes the run uses every device (set it to 0)"
        )
    if wanted > len(devices):
        raise UsageError(
            f"training.num_devices={wanted} but {len(devices)} devices are available; use "
            f"1..{len(devices)}, or 0 for every device"
        )
    return devices[:wanted]


def build_optimizer(run: RunConfig):
    """(optax transformation, learning-rate schedule): the one place the optimizer section
    becomes an optimizer."""
    o = run.optimizer
    return optim.make_optimizer(
        learning_rate=o.learning_rate,
        warmup_steps=o.warmup_steps,
        total_steps=run.decay_steps,
        end_learning_rate_ratio=o.end_learning_rate_ratio,
        b1=o.b1,
        b2=o.b2,
        eps=o.eps,
        weight_decay=o.weight_decay,
        clip_grad_norm=o.clip_grad_norm,
        decay_norms_and_embeddings=o.decay_norms_and_embeddings,
        schedule=o.schedule,
        decay_fraction=o.decay_fraction,
        decay_shape=o.decay_shape,
        muon=o.muon_options(),
    )


@dataclasses.dataclass(frozen=True)
class CheckpointModelSection(ModelSection):
    """A model section whose architecture is a Hugging Face checkpoint's (`init_from`, its
    config.json): `decoder_config()` builds that, with this section's runtime choices
    (`ModelSection.runtime_overrides`) on top; its preset and shape fields are not used."""

    init_from: str = ""

    def decoder_config(self):
        return read_config(self.init_from, **self.runtime_overrides())


def starting_from(run: RunConfig, init_from: str | None) -> RunConfig:
    """`run` as it starts from the checkpoint directory `init_from` (None: `run`): its model
    section builds the checkpoint's architecture, so code that reads the model from the run
    config (the planner, `auto`) sees the model train_main builds."""
    if init_from is None:
        return run
    if not os.path.isdir(init_from):
        raise UsageError(f"--init_from={init_from!r} is not a directory")
    section = {f.name: getattr(run.model, f.name) for f in dataclasses.fields(ModelSection)}
    model = CheckpointModelSection(**section, init_from=init_from)
    model.decoder_config()  # an unreadable config.json fails here, in one line
    return dataclasses.replace(run, model=model)


def check_positions(model_cfg, length: int, what: str) -> None:
    """UsageError (one line) when rows of `length` tokens run past a learned position table
    (GPT-2): a gather past its last row reads that row again, silently."""
    if getattr(model_cfg, "position", None) == "learned" and length > model_cfg.max_seq_len:
        raise UsageError(
            f"{what}={length} is longer than the model's learned position table "
            f"(max_seq_len={model_cfg.max_seq_len}); use {what} <= {model_cfg.max_seq_len}"
        )


def check_attention(model_cfg, mesh, seq_len: int) -> str:
    """The attention backend `model_cfg.attention_impl` runs on `mesh`'s platform for rows of
    `seq_len`; one-line UsageError when a backend named explicitly cannot run there."""
    return check_implementation(
        model_cfg.attention_impl,
        dtype=model_cfg.compute_dtype,
        head_dim=model_cfg.head_dim,
        seq_len=seq_len,
        platform=mesh.devices.flat[0].platform,
        interpret=model_cfg.attention_interpret,
    )


def on_mesh(tree, mesh):
    """Abstract leaves (typed on the abstract mesh of the trace) -> ShapeDtypeStructs with
    `NamedSharding`s on `mesh`, which is what `.lower` needs to compile for its devices."""

    def place(x):
        spec = x.sharding.spec if getattr(x, "sharding", None) is not None else None
        sharding = NamedSharding(mesh, spec or P())
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    return jax.tree.map(place, tree)


def model_config(run: RunConfig, init_from: str | None = None, model_cfg=None):
    """The zoo config the run builds: `model_cfg` when given, else the checkpoint's with
    `init_from` (the run's runtime choices on top), else the run's model section."""
    if model_cfg is not None:
        return model_cfg
    return starting_from(run, init_from).model.decoder_config()


def plan_run(
    run: RunConfig,
    mesh=None,
    *,
    init_from: str | None = None,
    devices=None,
    model_cfg=None,
) -> ModelPlan:
    """The run's model planned once (zoo.plan_model) on `mesh` (default: the strategy's mesh
    for the model, `training.mesh_shape` or its default rule, over `devices`, default
    `run_devices`),
    after the run's own checks: the remat policy on this platform, the batch split, the
    attention backend, the position table, and the pipeline's micro-batches.

    `init_from` / `model_cfg`: as `build` takes them."""
    model_cfg = model_config(run, init_from, model_cfg)
    strategy = run_strategy(run)
    if mesh is None:
        mesh = strategy.make_mesh(
            shape=run.training.mesh_shape or None,
            devices=run_devices(run) if devices is None else devices,
            config=model_cfg,
        )
    remat.check_platform(model_cfg.remat, mesh.devices.flat[0].platform)
    micro_batch = run.data.global_batch_size // run.optimizer.micro_batches
    check_batch(
        micro_batch,
        strategy.batch_spec(),
        mesh,
        strategy.name,
        seq_len=run.data.seq_len,
        residual_spec=strategy.lm_sharding().block.residual,
    )
    # An attention backend named in the config that cannot run here fails now, in one line,
    # not while the step compiles.
    check_attention(model_cfg, mesh, run.data.seq_len)
    check_positions(model_cfg, run.data.seq_len, "data.seq_len")
    plan = plan_model(model_cfg, strategy, mesh)  # the vocab padded where its split needs it
    plan.check_batch_size(micro_batch)
    return plan


def build(
    run: RunConfig,
    mesh=None,
    *,
    abstract: bool = False,
    init_from: str | None = None,
    devices=None,
    model_cfg=None,
    plan: ModelPlan | None = None,
) -> Run:
    """Build the run's model, optimizer and train step on `mesh` (default: the strategy's
    mesh over `devices`, default `run_devices`).

    Args:
      abstract: shapes only (nothing allocated, nothing initialised); the step can be
        lowered and compiled, not run.
      init_from: a Hugging Face checkpoint directory: its architecture and weights (weights
        only when concrete).
      model_cfg: a zoo config to use instead of the run's model section (benches).
      plan: the run's `plan_run`, when the caller made it already (then no `mesh`,
        `devices` or `model_cfg`).
    """
    if plan is None:
        plan = plan_run(run, mesh, init_from=init_from, devices=devices, model_cfg=model_cfg)
    elif mesh is not None or devices is not None or model_cfg is not None:
        raise TypeError("build takes a plan, or the mesh / devices / model_cfg to make one")
    tx, schedule = build_optimizer(run)
    seed = run.training.seed

    def adapted(model):
        # LoRA (lora.rank set): adapters that alone train; the base stays frozen.
        finetune.adapt(model, run.lora, seed)
        finetune.freeze_base(model, run.model.dtype)
        return model, nnx.Optimizer(model, tx, wrt=finetune.trainable(model))

    with jax.set_mesh(plan.mesh):
        if abstract:
            # The plan's shapes, placed: the model is not built again.
            model, optimizer = nnx.eval_shape(adapted, plan.abstract_model())
        elif init_from is not None:
            model, optimizer = adapted(from_pretrained(init_from, plan))
        else:
            model, optimizer = adapted(create_model(plan, rngs=nnx.Rngs(seed)))
    objective = preference.Objective.from_training(run.training)
    if objective is not None and plan.pipeline is not None and plan.pipeline.schedule == "1f1b":
        raise UsageError(
            f"training.objective={objective.name} cannot run under "
            "model.pipeline_schedule=1f1b: 1F1B computes the loss inside its loop as one sum "
            "over tokens, and a preference loss needs each sequence's log probability; set "
            "model.pipeline_schedule=gpipe (or circular)"
        )
    # DPO's reference without LoRA: the starting weights, copied before any step or restore.
    needs_copy = objective is not None and objective.needs_reference
    trainer = Trainer(
        model,
        optimizer,
        micro_batches=run.optimizer.micro_batches,
        batch_spec=plan.strategy.batch_spec(),
        loss_chunk_size=run.training.loss_chunk_size,
        wrt=finetune.trainable(model),
        pipeline=plan.pipeline,
        objective=objective,
        reference=preference.frozen_copy(model) if needs_copy else None,
        moe_bias_update_rate=run.training.moe_bias_update_rate,
        mtp_loss_weight=run.training.mtp_loss_weight,
    )
    if abstract:
        trainer.state = on_mesh(trainer.state, plan.mesh)
        if trainer.ref_state is not None:
            trainer.ref_state = on_mesh(trainer.ref_state, plan.mesh)
    return Run(
        config=run,
        plan=plan,
        model=model,
        optimizer=optimizer,
        trainer=trainer,
        schedule=schedule,
        abstract=abstract,
        init_from=init_from,
    )


def model_run(
    model_cfg,
    strategy_name: str,
    mesh,
    *,
    batch_size: int,
    seq_len: int,
    abstract: bool = False,
    loss_chunk_size: int = 0,
    micro_batches: int = 1,
    packed: bool = True,
) -> Run:
    """`build` for a zoo config rather than a run config (benches and tests that compile or
    time one step of a model on a mesh): the run's other sections take their defaults.
    `packed=False` states one document per row (no document mask)."""
    raw = {
        "model": {"preset": "tiny"},
        "data": {"seq_len": seq_len, "global_batch_size": batch_size},
        "training": {"sharding_strategy": strategy_name, "loss_chunk_size": loss_chunk_size},
        "optimizer": {"micro_batches": micro_batches},
    }
    built = build(RunConfig.from_config_dict(raw), mesh, abstract=abstract, model_cfg=model_cfg)
    built.trainer.packed = packed
    return built


def abstract_run(model_cfg, strategy_name: str, mesh, **kwargs) -> Run:
    """`model_run(..., abstract=True)`: shapes only, to compile for any target."""
    return model_run(model_cfg, strategy_name, mesh, abstract=True, **kwargs)
