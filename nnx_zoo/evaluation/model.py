"""The model to evaluate: rebuilt from a run's record and filled from its checkpoint, or read
from a Hugging Face directory, in the layout of the requested strategy and mesh."""

from __future__ import annotations

import dataclasses
import os

import jax
from flax import nnx

from nnx_zoo.checkpoint.restore import read_meta, restore_params
from nnx_zoo.data.tokenizers import make_tokenizer
from nnx_zoo.errors import UsageError
from nnx_zoo.evaluation.settings import EvalSettings, from_run_info, run_config
from nnx_zoo.launch.build import check_attention, check_positions
from nnx_zoo.training import finetune
from shardings import get_strategy
from zoo import abstract_model, create_model, from_pretrained, plan_model
from zoo.hf_io import read_config
from zoo.registry import config_types


@dataclasses.dataclass(frozen=True)
class LoadRequest:
    """Which model to load and how to lay it out: what eval_main, its --tasks and serve_main
    ask for alike."""

    workdir: str | None  # a run directory (None with hf_checkpoint)
    hf_checkpoint: str | None = None
    step: int | None = None
    # Runtime choices over the run's record (None keeps the recorded one); see from_run_info.
    overrides: dict = dataclasses.field(default_factory=dict)


def load(request: LoadRequest):
    """(settings, tokenizer, model, mesh, step): the request's model on its strategy's mesh,
    from the run's checkpoint or the Hugging Face directory."""
    run_info, step = None, request.step
    if request.hf_checkpoint is None:
        step, meta = read_meta(request.workdir, request.step)
        run_info = meta.get("run_info") or {}
    settings = from_run_info(run_info, hf_checkpoint=request.hf_checkpoint, **request.overrides)
    tokenizer = make_tokenizer(settings.tokenizer)
    if request.hf_checkpoint is not None:
        explicit_length = request.overrides.get("seq_len") is not None
        model, mesh, settings = load_from_hf(request.hf_checkpoint, settings, explicit_length)
    else:
        model, mesh, step = load_from_checkpoint(request.workdir, run_info, settings, step)
    return settings, tokenizer, model, mesh, step


def model_config_from_run_info(run_info: dict):
    """The zoo config the run trained: `run_info['model_config']` when recorded (type name
    and fields), else the run config's model section (`RunConfig.model.decoder_config()`)."""
    recorded = run_info.get("model_config")
    if recorded:
        types = config_types()
        fields = dict(recorded)
        name = fields.pop("type", None)
        if name not in types:
            raise UsageError(f"checkpoint model config type {name!r} is not in this zoo ({types})")
        config_type = types[name]
        for field in dataclasses.fields(config_type):
            if isinstance(fields.get(field.name), list):  # JSON turned tuples into lists
                fields[field.name] = tuple(fields[field.name])
        return config_type(**fields)
    return run_config(run_info).model.decoder_config()


def load_from_hf(hf_dir: str, settings: EvalSettings, explicit_length: bool = False):
    """(model, mesh, settings) read from a Hugging Face checkpoint directory; the settings'
    default row length is cut to a learned position table shorter than it (GPT-2's), while a
    --seq_len given past the table is refused."""

    strategy = get_strategy(settings.strategy)
    if not os.path.isdir(hf_dir):
        raise UsageError(f"--hf_checkpoint={hf_dir!r} is not a directory")
    overrides = {"attention_impl": settings.attention_impl} if settings.attention_impl else {}
    cfg = read_config(hf_dir, **overrides)
    if not explicit_length and getattr(cfg, "position", None) == "learned":
        settings = dataclasses.replace(settings, seq_len=min(settings.seq_len, cfg.max_seq_len))
    check_positions(cfg, settings.seq_len, "--seq_len")
    mesh = strategy.make_mesh(shape=settings.mesh_shape, config=cfg)
    check_attention(cfg, mesh, settings.seq_len)
    with jax.set_mesh(mesh):
        model = from_pretrained(hf_dir, strategy, **overrides)
    return model, mesh, settings


def load_from_checkpoint(workdir: str, run_info: dict, settings: EvalSettings, step: int | None):
    """(model, mesh, step): the run's model built under the requested strategy/mesh, with the
    parameters of checkpoint `step` (default: the latest), checked against its checksums."""

    strategy = get_strategy(settings.strategy)
    if run_config(run_info).lora.enabled:
        return load_adapted(workdir, run_info, settings, step)
    # Evaluation takes no gradients: what the backward pass would keep does not matter, and
    # a policy the evaluating backend lacks (offload, on CPU) must not stop it.
    cfg = model_config_from_run_info(run_info).replace(remat="none")
    # The backend the run trained with was a promise for training's calls; evaluation and
    # generation make others (KV-cache steps, T != S) on other hosts (a TPU run's checkpoint
    # read on a laptop), so only a backend named for this command binds it; else `auto`.
    cfg = cfg.replace(attention_impl=settings.attention_impl or "auto")
    mesh = strategy.make_mesh(shape=settings.mesh_shape, config=cfg)
    # A backend named here must run here: one line now, not an error deep in the compile.
    check_attention(cfg, mesh, settings.seq_len)
    # Training refused rows past a learned position table (GPT-2's), where every later
    # position would read the table's last row; an eval --seq_len could ask for them here.
    check_positions(cfg, settings.seq_len, "--seq_len")
    # The run's padded vocab (if any) where it divides this mesh's split, else padded anew
    # (restore_params then pads or cuts the rows that hold no token).
    with jax.set_mesh(mesh):
        # Shapes only: the checkpoint's arrays are read straight into the layout, so the model
        # is never initialised (and never held twice).
        plan = plan_model(cfg, strategy, mesh)
        model = abstract_model(plan)
        step = restore_params(workdir, model, step)
        if not all(isinstance(x, jax.Array) for x in jax.tree.leaves(nnx.state(model))):
            # State besides the parameters (none in today's families) needs real values.
            model = create_model(plan, rngs=nnx.Rngs(0))
            step = restore_params(workdir, model, step)
    return model, mesh, step


def load_adapted(workdir: str, run_info: dict, settings: EvalSettings, step: int | None):
    """(model, mesh, step) of a LoRA run: the base read from the run's `init_from` directory,
    its adapters from checkpoint `step` (a LoRA checkpoint holds nothing else)."""
    run = run_config(run_info)
    base = run_info.get("init_from")
    if not base or not os.path.isdir(base):
        raise UsageError(
            f"the LoRA run's base model {base!r} (run_info.json init_from) is not a directory"
        )
    strategy = get_strategy(settings.strategy)
    overrides = dict(
        dtype=run.model.dtype,
        scan_layers=run.model.scan_layers,
        attention_impl=settings.attention_impl or "auto",  # as load_from_checkpoint
    )
    cfg = read_config(base, **overrides)
    mesh = strategy.make_mesh(shape=settings.mesh_shape, config=cfg)
    check_attention(cfg, mesh, settings.seq_len)
    check_positions(cfg, settings.seq_len, "--seq_len")
    with jax.set_mesh(mesh):
        model = from_pretrained(base, strategy, **overrides)
        # Dropout only trains; the adapters' values come from the checkpoint.
        finetune.adapt(model, dataclasses.replace(run.lora, dropout=0.0))
        finetune.freeze_base(model, run.model.dtype)
        step = restore_params(workdir, model, step)
    return model, mesh, step
