"""The evaluation's settings: the run's own record (its checkpoint's `run_info`), with the
command line's runtime choices on top."""

from __future__ import annotations

import dataclasses

from nnx_zoo.errors import UsageError
from nnx_zoo.training.config import RunConfig, TrainingSection

# Defaults for a Hugging Face checkpoint, which has no run record.
HF_DEFAULTS = dict(source="default", seq_len=512, global_batch_size=8, eval_batches=4)


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    strategy: str
    mesh_shape: str | None
    source: str
    split: str
    tokenizer: str
    text_field: str
    validation_fraction: float
    seq_len: int
    batch_size: int
    eval_batches: int
    # Tokens per device per chunk of the LM head fused with the loss (0: full logits): the
    # run's `training.loss_chunk_size`, or its default for a Hugging Face checkpoint.
    loss_chunk_size: int
    # The attention backend to evaluate with (xla|cudnn|splash|auto); None: the run's own.
    attention_impl: str | None = None
    # text | chat | prompt_completion (nnx_zoo/data/chat.py): the run's; chat data counts answers
    # only.
    data_format: str = "text"
    # The run's data.mixture ('' for none): then the validation batches are its sources'
    # validation splits mixed by weight, as the run computed val_loss.
    mixture: str = ""


def _default_loss_chunk_size() -> int:

    return TrainingSection().loss_chunk_size


def run_config(run_info: dict):
    """The typed RunConfig recorded in a checkpoint's run_info."""

    if "config" not in run_info:
        raise UsageError("the checkpoint's run_info records no 'config'; cannot rebuild the run")
    return RunConfig.from_config_dict(run_info["config"])


def from_run_info(
    run_info: dict | None,
    *,
    hf_checkpoint: str | None = None,
    data: str | None = None,
    mesh_shape: str | None = None,
    attention_impl: str | None = None,
    **overrides,
) -> EvalSettings:
    """Settings from the run's record (or the HF defaults when `run_info` is None); each of
    `overrides` (strategy, tokenizer, seq_len, batch_size, eval_batches, loss_chunk_size) that
    is not None replaces the recorded value. `data` evaluates all of that source instead of
    the run's validation split (its `data.validation_source` whole, when it had one)."""
    if run_info is not None:
        run = run_config(run_info)
        d = run.data
        base = dict(
            strategy=run_info.get("strategy", run.training.sharding_strategy),
            source=d.source,
            tokenizer=d.tokenizer,
            text_field=d.text_field,
            validation_fraction=d.validation_fraction,
            seq_len=d.seq_len,
            batch_size=d.global_batch_size,
            eval_batches=run.training.eval_batches,
            loss_chunk_size=run.training.loss_chunk_size,
        )
        data_format, mixture = d.format, d.mixture
    else:
        mixture = ""
        data_format = "text"
        base = dict(
            strategy="fsdp_tp",
            source=HF_DEFAULTS["source"],
            tokenizer=hf_checkpoint,
            text_field="text",
            validation_fraction=0.02,
            seq_len=HF_DEFAULTS["seq_len"],
            batch_size=HF_DEFAULTS["global_batch_size"],
            eval_batches=HF_DEFAULTS["eval_batches"],
            loss_chunk_size=_default_loss_chunk_size(),
        )
    for key, value in overrides.items():
        if key not in base or key == "source":
            raise TypeError(f"unknown evaluation setting {key!r}")
        if value is not None:
            base[key] = value
    for key in ("seq_len", "batch_size", "eval_batches"):
        if base[key] < 1:
            raise UsageError(f"--{key}={base[key]} must be >= 1")
    if base["loss_chunk_size"] < 0:
        raise UsageError(
            f"--loss_chunk_size={base['loss_chunk_size']} must be >= 0 (0: full logits)"
        )
    source = base.pop("source")
    # The run's own held-out source (data.validation_source) is validated on whole.
    held_out = run_info is not None and run.data.validation_source
    return EvalSettings(
        mesh_shape=mesh_shape,
        attention_impl=attention_impl,
        source=data or held_out or source,
        split="all" if data or held_out else "validation",
        data_format=data_format,
        mixture="" if data else mixture,
        **base,
    )
