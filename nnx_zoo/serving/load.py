"""What serve_main serves: the model loaded as eval_main loads it (a workdir's checkpoint on
any strategy and mesh, a LoRA run's base with its adapters, or a Hugging Face directory), its
tokenizer and chat template, and the engine over them.

Every mistake in what the user gave surfaces as `UsageError` (one line) before anything listens.
"""

from __future__ import annotations

import dataclasses
import os

import jax

from nnx_zoo.data.chat import ChatTemplate
from nnx_zoo.errors import UsageError
from nnx_zoo.evaluation.model import LoadRequest, load
from nnx_zoo.serving.engine import Engine
from nnx_zoo.serving.slots import Slots
from zoo.generate import check_can_generate
from zoo.layers.lora import has_lora, merge_lora

LORA_MODES = ("merge", "apply")
# The context a slot holds when --max_seq_len is not given, below the model's own limit:
# the KV cache is max_batch x this many columns of every layer.
DEFAULT_MAX_SEQ_LEN = 2048


@dataclasses.dataclass(frozen=True)
class ServeRequest:
    load: LoadRequest  # the model: which checkpoint, and its layout here
    max_batch: int = 8
    max_seq_len: int | None = None  # None: min(the model's max_seq_len, DEFAULT_MAX_SEQ_LEN)
    max_queue: int = 64
    lora: str = "merge"  # merge: adapters folded into the weights; apply: kept apart
    chat_template: str | None = None  # a Jinja file; None: the tokenizer directory's
    served_model_name: str | None = None  # None: the workdir's (or HF directory's) name
    warmup: bool = True  # compile decode and every prefill bucket before serving


@dataclasses.dataclass
class Served:
    engine: Engine
    name: str
    chat_template: ChatTemplate | None
    chat_template_error: str | None
    description: str  # one line: what runs where


def build(request: ServeRequest) -> Served:
    if request.lora not in LORA_MODES:
        raise UsageError(f"--lora={request.lora!r}: must be one of {', '.join(LORA_MODES)}")
    if request.max_seq_len is not None and request.max_seq_len < 1:
        raise UsageError(f"--max_seq_len={request.max_seq_len} must be >= 1")
    strategy = request.load.overrides.get("strategy")
    if strategy:
        check_can_generate(strategy, "serve_main")  # before reading the checkpoint
    template, template_error = chat_template(request)  # a bad --chat_template: before loading
    settings, tokenizer, model, mesh, step = load(request.load)
    check_can_generate(settings.strategy, "serve_main")
    if has_lora(model) and request.lora == "merge":
        with jax.set_mesh(mesh):
            merge_lora(model)
    max_seq_len = request.max_seq_len or min(model.cfg.max_seq_len, DEFAULT_MAX_SEQ_LEN)
    slots = Slots(model, max_batch=request.max_batch, max_seq_len=max_seq_len)
    del model  # the slots hold the weights (one array per layer)
    if template is None and template_error is None:
        template, template_error = _tokenizer_template(settings.tokenizer)
    engine = Engine(slots, tokenizer, max_queue=request.max_queue)
    if request.warmup:
        slots.compile_decode()
        for bucket in slots.buckets:
            slots.compile_prefill(bucket)
    source = request.load.hf_checkpoint or request.load.workdir
    name = request.served_model_name or os.path.basename(os.path.normpath(source))
    what = f"hf checkpoint {source}" if request.load.hf_checkpoint else f"{source} step {step}"
    description = (
        f"{what} ({settings.strategy} on {dict(mesh.shape)}), {request.max_batch} slots x "
        f"{max_seq_len} tokens, queue {request.max_queue}"
    )
    return Served(engine, name, template, template_error, description)


def chat_template(request: ServeRequest) -> tuple[ChatTemplate | None, str | None]:
    """(--chat_template's template, None), or (None, None) when the flag is not given."""
    path = request.chat_template
    if path is None:
        return None, None
    path = os.path.expanduser(path)
    if not os.path.isfile(path):
        raise UsageError(f"--chat_template={path!r} is not a file (a Jinja template)")
    with open(path, encoding="utf-8") as f:
        return ChatTemplate(f.read(), source=path), None


def _tokenizer_template(tokenizer_spec: str) -> tuple[ChatTemplate | None, str | None]:
    """The tokenizer directory's own template, or (None, why chat requests are refused)."""
    hint = "start serve_main with --chat_template=FILE (a Jinja chat template)"
    if tokenizer_spec == "byte":
        return None, f"this model's byte tokenizer has no chat template; {hint}"
    try:
        return ChatTemplate.from_dir(tokenizer_spec), None
    except (ValueError, OSError) as e:
        return None, f"{' '.join(str(e).split())}; {hint}"
