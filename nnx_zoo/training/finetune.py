"""Fine-tuning hooks of a run: the data format's tokenizer and chat template, LoRA adapters on
the model, and what the optimizer trains. nnx_zoo/launch/ calls these; evaluation and export
call `adapt` to rebuild an adapted model from a run's record.

LoRA runs keep only the adapters in their checkpoints (and the optimizer state of the
adapters): the base is the `--init_from` directory that run_info.json points at
(`init_from`), read again on restore.
"""

from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp
from flax import nnx

from nnx_zoo.data.chat import ChatTemplate
from nnx_zoo.errors import UsageError
from zoo.layers.lora import add_lora, has_lora
from zoo.layers.lora import trainable as trainable_kind


def with_data_tokenizer(run, init_from: str | None):
    """`run` with the tokenizer its data uses: chat and instruction data starting from a
    checkpoint use that checkpoint's tokenizer (and chat template) unless one is named. The
    run config records it, for evaluation, export and resume."""
    if run.data.format != "text" and run.data.tokenizer == "byte" and init_from:
        return dataclasses.replace(run, data=dataclasses.replace(run.data, tokenizer=init_from))
    return run


def chat_template(run, tokenizer_spec: str):
    """The checkpoint's ChatTemplate for chat records; None for other formats (plain
    prompt/completion strings need none, a message-list record finds out when encoded)."""
    if run.data.format == "text":
        return None
    if tokenizer_spec == "byte":
        if run.data.format == "chat":
            raise UsageError(
                "config data.format=chat needs the checkpoint's tokenizer and chat template: "
                "--init_from=HF_DIR or --config.data.tokenizer=DIR"
            )
        return None
    path = os.path.expanduser(tokenizer_spec)
    try:
        return ChatTemplate.from_dir(path)
    except ValueError:
        if run.data.format == "chat":
            raise
        return None


def adapt(model, lora_section, seed: int = 0) -> list[str]:
    """Attach the run's LoRA adapters (none when lora.rank is unset), under the active mesh."""
    config = lora_section.lora_config()
    if config is None:
        return []
    return add_lora(model, config, nnx.Rngs(params=seed + 1, dropout=seed + 2))


def check_lora_run(run, init_from: str | None) -> None:
    """LoRA trains adapters on a base that a checkpoint directory holds."""
    if run.lora.enabled and not init_from:
        raise UsageError(
            "config lora.rank is set but there is no base model: LoRA fine-tunes a "
            "checkpoint, start with --init_from=HF_DIR"
        )


def trainable(model):
    """The variable type the optimizer trains: the adapters' with LoRA, else nnx.Param."""
    return trainable_kind(model)


def freeze_base(model, dtype: str) -> None:
    """With adapters, the frozen base may be stored in bfloat16 (model.dtype=bfloat16):
    half the bytes, and no gradient or optimizer state of its own either way."""
    if dtype != "bfloat16" or not has_lora(model):
        return
    for _, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        var.set_value(var[...].astype(jnp.bfloat16))
