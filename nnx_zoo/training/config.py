"""The run config at the boundary: an ml_collections ConfigDict in, typed frozen dataclasses out.

`configs/*.py` hold the ConfigDicts (a comment on every field); `train_main.py` converts one
with `RunConfig.from_config_dict` right after flag parsing, and nothing past that point reads
the ConfigDict. Every check here raises UsageError with one line naming the field, its value
and what would be valid, so `main` can print it and exit with status 2.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from nnx_zoo.errors import UsageError
from nnx_zoo.training.mixture_spec import MixtureComponent, parse_mixture
from nnx_zoo.training.schedules import DECAY_SHAPES, SCHEDULES, max_warmup
from zoo.layers.config import ATTENTION_IMPLEMENTATIONS, CONTEXT_PARALLEL, RUNTIME_FIELDS
from zoo.layers.lora import LoraConfig
from zoo.layers.pipeline_schedules import resolve_schedule
from zoo.layers.quant import QUANTIZATIONS
from zoo.layers.remat import POLICIES as REMAT_POLICIES
from zoo.registry import PRESET_DIMS

SECTIONS = ("model", "data", "optimizer", "training", "checkpoint", "logging", "lora", "eval")
# nnx_zoo/data/chat.py's FORMATS, and preference pairs (nnx_zoo/data/preference.py)
DATA_FORMATS = ("text", "chat", "prompt_completion", "preference")
# nnx_zoo/training/preference.py's OBJECTIVES, and sft (next-token loss)
OBJECTIVES = ("sft", "dpo", "orpo", "simpo")
CHAT_OVERFLOW = ("drop", "truncate_left", "error")  # nnx_zoo/data/chat.py's OVERFLOW
DEFAULT_SOURCE = "default"  # nnx_zoo/data/sources.py's DEFAULT_SOURCE
OPTIMIZERS = ("adamw", "muon")


def _fail(section: str, field: str, value: Any, why: str) -> None:
    raise UsageError(f"config {section}.{field}={value!r}: {why}")


def _positive(section: str, obj, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        # `not value > 0` also refuses NaN, which every comparison calls False.
        if value is not None and not value > 0:
            _fail(section, name, value, "must be > 0")


def _finite(section: str, obj) -> None:
    """Every float field of a section is a finite number. _coerce checks a config file's
    values, but a section is also built by `dataclasses.replace` from a run flag
    (`--peak_tflops=inf`) or in code, and an inf or NaN that passes a range check (`inf > 0`)
    would reach the step as a silent nonsense figure."""
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        if field.type.replace(" ", "").removesuffix("|None") != "float" or value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            _fail(section, field.name, value, "must be a number")
        if not math.isfinite(value):
            _fail(section, field.name, value, "must be a finite number")


@dataclasses.dataclass(frozen=True)
class ModelSection:
    preset: str = "tiny"  # a zoo preset (zoo.get_config): tiny, llama3.2-1b, qwen3-0.6b, gpt2, ...
    # Shape overrides of the preset; None keeps the preset's value.
    vocab_size: int | None = None  # V; must be >= the tokenizer's vocabulary
    hidden_dim: int | None = None  # M, residual width
    num_layers: int | None = None  # L
    num_heads: int | None = None  # N, query heads
    num_kv_heads: int | None = None  # K, key/value heads (divides N, and the model axis)
    head_dim: int | None = None  # D
    ffn_dim: int | None = None  # F, MLP hidden width
    max_seq_len: int | None = None  # KV-cache length for generation
    dtype: str = "float32"  # compute dtype, float32 | bfloat16 (parameters stay float32)
    scan_layers: bool = True  # stack layers and run them with nnx.scan: one compiled block
    # Layers per scan iteration: 0 = auto (all of them on CPU with remat=none, 10-20% faster
    # there; else 1), 1 = rolled (fastest compile, least memory), n = n per iteration.
    scan_unroll: int = 0
    # What the backward pass recomputes: none | full | dots | save_qkv_proj | save_out_proj |
    # offload (the residual stream to host memory; TPU/GPU only). See zoo/layers/remat.py.
    remat: str = "none"
    # xla (einsums, everywhere) | splash (Pallas flash kernel, TPU) | cudnn (fused attention,
    # NVIDIA GPU, bf16) | auto (splash on TPU, cudnn on GPU, xla on CPU); packed rows on all.
    # --attention_impl overrides; an explicit backend that cannot run here is an error.
    attention_impl: str = "xla"
    attention_interpret: bool = False  # run splash in Pallas interpret mode (CPU tests; slow)
    # T split over `context` (fsdp_cp, fsdp_tp_cp): all_gather (every device gathers all K/V)
    # | ring (K/V blocks rotated by collective-permutes, online softmax: K/V memory / context).
    context_parallel: str = "all_gather"
    # MoE expert parallelism (zoo/layers/moe_exchange.py): 'auto' | 'ragged' | 'padded', and
    # the padded exchange's capacity factor (0: dropless).
    moe_exchange: str = "auto"
    moe_capacity_factor: float = 0.0
    # The experts' grouped matmul: 'auto' (tiled on GPU, ragged_dot elsewhere) | 'ragged_dot'
    # | 'tiled' (zoo/layers/grouped_matmul.py, docs/moe.md).
    moe_matmul: str = "auto"
    # Pipeline strategies (fsdp_pp, fsdp_tp_pp; zoo/layers/pipeline.py): micro-batches each
    # forward pass is cut into (0: one per stage; at least the stages), and repeats (virtual
    # stages per device: 1 is GPipe, more is the circular schedule, bubble
    # (S-1)/(micro-batches*repeats + S-1)).
    pipeline_microbatches: int = 0
    pipeline_repeats: int = 1
    # auto (gpipe for repeats 1, circular above) | gpipe | circular | 1f1b (repeats 1: a
    # forward and a backward per iteration, the loss inside the pipeline, so a device keeps
    # at most 2 x stages micro-batches' activations, not every one; docs/pipeline-1f1b.md).
    pipeline_schedule: str = "auto"
    # Projections (q/k/v/o, MLP) in low precision, forward and backward: none | fp8 (e4m3,
    # e5m2 gradients; fp8 GEMMs on H100/H200) | int8 (TPU's int8 MXU path). zoo/layers/quant.py
    quantization: str = "none"
    # Multi-token prediction depths (DeepSeek-V3 only; docs/deepseek_v3.md): D extra
    # next-next-token heads trained beside the model, their loss weighted by
    # training.mtp_loss_weight. 0: off. Refused under pipeline strategies.
    mtp_depth: int = 0

    # What the model is (a preset's dims, overridden where set) and how it runs (with
    # --init_from a checkpoint fixes the former and the latter still apply).
    SHAPE_FIELDS = PRESET_DIMS
    RUNTIME_FIELDS = RUNTIME_FIELDS

    def __post_init__(self):
        _finite("model", self)
        _positive("model", self, *self.SHAPE_FIELDS)
        if self.scan_unroll < 0:
            _fail("model", "scan_unroll", self.scan_unroll, "valid: 0 (auto), 1 (rolled), or more")
        if self.pipeline_microbatches < 0:
            _fail("model", "pipeline_microbatches", self.pipeline_microbatches, "valid: >= 0")
        if self.mtp_depth < 0:
            _fail("model", "mtp_depth", self.mtp_depth, "valid: 0 (off) or >= 1 depths")
        if self.pipeline_repeats < 1:
            _fail("model", "pipeline_repeats", self.pipeline_repeats, "valid: >= 1 (1: GPipe)")
        try:
            resolve_schedule(self.pipeline_schedule, self.pipeline_repeats)
        except ValueError as e:  # its line names the field, its value and what is valid
            raise UsageError(f"config model.{e}") from None
        for name, valid in (
            ("dtype", ("float32", "bfloat16")),
            ("remat", REMAT_POLICIES),
            ("attention_impl", ATTENTION_IMPLEMENTATIONS),
            ("context_parallel", CONTEXT_PARALLEL),
            ("moe_exchange", ("auto", "ragged", "padded")),
            ("moe_matmul", ("auto", "ragged_dot", "tiled")),
            ("quantization", QUANTIZATIONS),
        ):
            if getattr(self, name) not in valid:
                _fail("model", name, getattr(self, name), f"valid: {', '.join(valid)}")
        if not self.moe_capacity_factor >= 0:
            _fail("model", "moe_capacity_factor", self.moe_capacity_factor, "0 (dropless) or > 0")

    def overrides(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.SHAPE_FIELDS if getattr(self, k) is not None}
        return {**out, **self.runtime_overrides()}

    def runtime_overrides(self) -> dict[str, Any]:
        """The choices of how the model runs, not what it is."""
        return {k: getattr(self, k) for k in self.RUNTIME_FIELDS}

    def decoder_config(self):
        """The zoo's frozen model config: the preset with this section's overrides."""
        from zoo import get_config

        return get_config(self.preset, **self.overrides())


@dataclasses.dataclass(frozen=True)
class DataSection:
    source: str = "default"  # 'default' (stdlib source text, no download) or a path/dir/glob
    tokenizer: str = "byte"  # 'byte', a tokenizer.json (or its dir), or a SentencePiece .model
    text_field: str = "text"  # JSONL field / Parquet column holding the text
    seq_len: int = 128  # T, tokens per packed row
    global_batch_size: int = 16  # rows per optimizer step, over all processes and micro-batches
    num_workers: int = 0  # Grain worker processes for reading/tokenizing (0: in-process)
    shuffle_seed: int = 0  # seeds document shuffling and packing order
    validation_fraction: float = 0.02  # share of documents held out for validation loss
    # A separate held-out source (text path/dir/glob, or pre-tokenized ArrayRecord), validated
    # on whole; the training source is then not split (all of it trains, and
    # validation_fraction is unused). '': validate on the hashed validation_fraction of source.
    validation_source: str = ""
    # text: documents, loss on every token | chat: JSONL/Parquet records with `messages`
    # (role/content), rendered with the tokenizer dir's chat template, loss on the assistant
    # turns | prompt_completion: records with `prompt` and `completion`, loss on completions
    # | preference: records with `prompt`, `chosen` and `rejected` (training.objective
    # dpo / orpo / simpo; docs/preference.md).
    format: str = "text"
    # A chat / prompt_completion record longer than seq_len (never split: its answer would
    # train without its prompt): drop it (counted in one line at start) | truncate_left (keep
    # its last seq_len tokens) | error (stop, naming it).
    chat_overflow: str = "drop"
    # Several sources mixed by weight, 'name:source:weight,...' (e.g.
    # 'code:/data/code:0.7,web:/data/web/*.jsonl:0.3'): each packed row comes from one
    # source, each source's share of the rows is its weight (normalized); data.source then
    # stays 'default'. '' reads data.source alone. docs/data.md#weighted-mixtures
    mixture: str = ""

    def __post_init__(self):
        _finite("data", self)
        _positive("data", self, "seq_len", "global_batch_size")
        if self.format not in DATA_FORMATS:
            _fail("data", "format", self.format, f"valid: {', '.join(DATA_FORMATS)}")
        if self.chat_overflow not in CHAT_OVERFLOW:
            _fail("data", "chat_overflow", self.chat_overflow, f"valid: {', '.join(CHAT_OVERFLOW)}")
        if self.num_workers < 0:
            _fail("data", "num_workers", self.num_workers, "must be >= 0")
        if not 0 < self.validation_fraction < 1:
            _fail("data", "validation_fraction", self.validation_fraction, "must be in (0, 1)")
        if not self.source:
            _fail("data", "source", self.source, "'default' or a path / directory / glob")
        if self.mixture_components() and self.source != DEFAULT_SOURCE:
            _fail(
                "data",
                "source",
                self.source,
                "leave it at 'default' when data.mixture is set (the mixture names the sources)",
            )

    def mixture_components(self) -> tuple[MixtureComponent, ...]:
        """data.mixture's (name, source, normalized weight) triples; () without a mixture."""
        return parse_mixture(self.mixture)


@dataclasses.dataclass(frozen=True)
class OptimizerSection:
    # adamw | muon: Muon on the blocks' projection matrices, optax's Nesterov AdamW on the
    # rest (embeddings, head, norms, biases, router), both at learning_rate and weight_decay.
    # nnx_zoo/training/muon.py, docs/muon.md
    name: str = "adamw"
    muon_momentum: float = 0.95  # Muon's Nesterov momentum
    muon_ns_steps: int = 5  # Newton-Schulz iterations per step
    # Muon's updates scaled to this RMS x sqrt(max(rows, cols)), so AdamW's learning rate
    # carries over (Liu et al. 2025); 0: scaled by sqrt(max(1, cols / rows)) (Jordan).
    muon_consistent_rms: float = 0.2
    learning_rate: float = 3e-4  # peak rate, reached after warmup
    warmup_steps: int = 0  # linear warmup from 0
    # cosine | wsd (warmup, stable at the peak, decay over the last decay_fraction) |
    # constant (warmup, then the peak); the formulas: nnx_zoo/training/schedules.py
    schedule: str = "cosine"
    # Schedule length incl. warmup: the step its decay ends; None: training.steps
    decay_steps: int | None = None
    end_learning_rate_ratio: float = 0.1  # final rate as a fraction of the peak (cosine, wsd)
    decay_fraction: float = 0.2  # wsd: the decay's share of the schedule length
    decay_shape: str = "linear"  # wsd: linear | 1-sqrt (1 - sqrt of the decay's progress)
    weight_decay: float = 0.1  # decoupled AdamW decay (off for norms and embeddings)
    clip_grad_norm: float = 1.0  # clip the global gradient norm; <= 0 turns clipping off
    b1: float = 0.9  # Adam first-moment decay
    b2: float = 0.95  # Adam second-moment decay
    eps: float = 1e-8  # Adam epsilon
    micro_batches: int = 1  # gradient accumulation: k micro-batches of global_batch_size / k
    decay_norms_and_embeddings: bool = False  # True: decay every parameter

    def __post_init__(self):
        _finite("optimizer", self)
        if self.name not in OPTIMIZERS:
            _fail("optimizer", "name", self.name, f"valid: {', '.join(OPTIMIZERS)}")
        if not 0 <= self.muon_momentum < 1:
            _fail("optimizer", "muon_momentum", self.muon_momentum, "must be in [0, 1)")
        if self.muon_consistent_rms < 0:
            _fail("optimizer", "muon_consistent_rms", self.muon_consistent_rms, "must be >= 0")
        _positive("optimizer", self, "learning_rate", "micro_batches", "eps", "decay_steps")
        _positive("optimizer", self, "muon_ns_steps")
        if self.warmup_steps < 0:
            _fail("optimizer", "warmup_steps", self.warmup_steps, "must be >= 0")
        if self.schedule not in SCHEDULES:
            _fail("optimizer", "schedule", self.schedule, f"must be one of {', '.join(SCHEDULES)}")
        if self.decay_shape not in DECAY_SHAPES:
            _fail(
                "optimizer", "decay_shape", self.decay_shape, f"must be {' or '.join(DECAY_SHAPES)}"
            )
        if not 0 < self.decay_fraction <= 1:
            _fail("optimizer", "decay_fraction", self.decay_fraction, "must be in (0, 1]")
        for name in ("b1", "b2"):
            if not 0 <= getattr(self, name) < 1:
                _fail("optimizer", name, getattr(self, name), "must be in [0, 1)")
        if self.weight_decay < 0:
            _fail("optimizer", "weight_decay", self.weight_decay, "must be >= 0")
        if not 0 <= self.end_learning_rate_ratio <= 1:
            _fail(
                "optimizer",
                "end_learning_rate_ratio",
                self.end_learning_rate_ratio,
                "must be in [0, 1]",
            )

    def muon_options(self):
        """Muon's settings (a `training.muon.MuonOptions`) when `name` is muon; None: AdamW."""
        if self.name != "muon":
            return None
        from nnx_zoo.training.muon import MuonOptions

        return MuonOptions(self.muon_momentum, self.muon_ns_steps, self.muon_consistent_rms)


@dataclasses.dataclass(frozen=True)
class TrainingSection:
    steps: int = 100  # optimizer steps in the run
    seed: int = 0  # parameter initialisation seed
    # A name in shardings.STRATEGIES, or auto (--sharding_strategy overrides).
    sharding_strategy: str = "fsdp_tp"
    mesh_shape: str = ""  # e.g. 'data:4,model:2'; '' = the strategy's default (--mesh_shape)
    # Run on the first N devices of this one process (one GPU of several, or 1/2/4 of the
    # simulated CPU devices); 0: every device.
    num_devices: int = 0
    eval_every: int = 0  # validation loss every N steps (and at the end); 0: only at the end
    eval_batches: int = 4  # global batches of validation data per evaluation
    # Tokens per device per chunk of the LM head fused with the loss (train and eval): a
    # device holds the logits of this many tokens at a time, never its [B, T, V] share.
    # 0: build the full logits.
    loss_chunk_size: int = 1024
    # Several processes: seconds a process that stops answering (a frozen host, a network
    # partition) may stay silent before every other process exits with one line naming it
    # (nnx_zoo/runtime/peers.py); a killed or crashed one is noticed at once. 60: well above any
    # pause of a live process's heartbeat thread, well below the minutes a dead host would bill.
    # JAX's own heartbeat and shutdown timeouts are derived from it. 0: no watch of our own
    # (JAX's defaults: its 100 s heartbeat timeout ends the others by SIGABRT, 51-99 s after
    # a death in the kills measured; README).
    peer_timeout_seconds: float = 60.0
    # sft: next-token loss | dpo: DPO's sigmoid loss against a reference model (the base
    # with LoRA's adapters off, else a frozen copy of the starting weights) | orpo | simpo:
    # reference-free. dpo / orpo / simpo read data.format=preference. docs/preference.md
    objective: str = "sft"
    dpo_beta: float = 0.1  # DPO's beta: the strength of the implicit KL to the reference
    dpo_label_smoothing: float = 0.0  # cDPO: the share of pairs assumed mislabelled, [0, 0.5)
    orpo_beta: float = 0.1  # ORPO's lambda: the odds-ratio term's weight beside the NLL
    simpo_beta: float = 2.0  # SimPO's beta: the scale of the length-normalized reward
    simpo_gamma: float = 1.0  # SimPO's target reward margin gamma (TRL CPOConfig.simpo_gamma)
    # DeepSeek-V3's auxiliary-loss-free balancing (arXiv 2412.19437, 2.1.2): after each step
    # every routed expert's correction bias moves by this much towards balance, bias +=
    # rate * sign(mean load - its load) per layer: an explicit update, not a gradient. 0: the
    # bias stays as loaded (DeepSeek-V3 used 0.001 for most of its pre-training). Models
    # without the bias ignore it.
    moe_bias_update_rate: float = 0.0
    # Multi-token prediction's weight (model.mtp_depth > 0): the objective is the next-token
    # loss + this x the mean over depths of each depth's loss (the report's lambda: 0.3 for
    # its first 10T tokens, 0.1 for the last 4.8T). Ignored without MTP.
    mtp_loss_weight: float = 0.3

    def __post_init__(self):
        _finite("training", self)
        if self.objective not in OBJECTIVES:
            _fail("training", "objective", self.objective, f"valid: {', '.join(OBJECTIVES)}")
        _positive("training", self, "dpo_beta", "orpo_beta", "simpo_beta")
        if not 0 <= self.dpo_label_smoothing < 0.5:
            _fail(
                "training", "dpo_label_smoothing", self.dpo_label_smoothing, "must be in [0, 0.5)"
            )
        _positive("training", self, "steps", "eval_batches")
        if not self.mtp_loss_weight >= 0:
            _fail("training", "mtp_loss_weight", self.mtp_loss_weight, "must be >= 0")
        if not self.moe_bias_update_rate >= 0:
            _fail("training", "moe_bias_update_rate", self.moe_bias_update_rate, "must be >= 0")
        if not 0 <= self.peer_timeout_seconds < math.inf:
            _fail(
                "training",
                "peer_timeout_seconds",
                self.peer_timeout_seconds,
                "must be >= 0 seconds (0: no peer watch, JAX's own heartbeat only)",
            )
        if self.loss_chunk_size < 0:
            _fail(
                "training",
                "loss_chunk_size",
                self.loss_chunk_size,
                "must be >= 0 (tokens per device per loss chunk; 0: full logits)",
            )
        if self.eval_every < 0:
            _fail("training", "eval_every", self.eval_every, "must be >= 0 (0: only at the end)")
        if self.num_devices < 0:
            _fail("training", "num_devices", self.num_devices, "must be >= 0 (0: every device)")


@dataclasses.dataclass(frozen=True)
class CheckpointSection:
    enabled: bool = True  # save under <workdir>/checkpoints and resume from there
    every: int = 100  # save every N steps (and at the end)
    keep: int = 3  # keep the last N checkpoints
    async_save: bool = True  # write in the background; training blocks for the host copy only

    def __post_init__(self):
        _positive("checkpoint", self, "every", "keep")


@dataclasses.dataclass(frozen=True)
class LoggingSection:
    log_every: int = 10  # metrics.jsonl / TensorBoard / progress-bar line every N steps
    peak_tflops: float | None = None  # per-device peak for MFU; None: table, or measured on CPU
    progress_bar: bool = True  # tqdm bar on stderr (process 0)
    tensorboard: bool = True  # TensorBoard event files under <workdir>/tensorboard
    loss_curve: bool = True  # <workdir>/loss_curve.png at the end of the run (matplotlib)
    # 'START:END': a jax.profiler trace of steps START..END-1 (metrics.jsonl's step numbers)
    # into <workdir>/profile, for TensorBoard's profile plugin / XProf; '' traces nothing.
    profile_steps: str = ""
    # Weights & Biases (extra [wandb]; process 0 only): the project to log to ('' logs
    # nothing there). The run's config and run_info are the W&B config; a resumed run goes on
    # in the same W&B run (its id is kept in <workdir>/wandb_run.json). docs/training.md
    wandb_project: str = ""
    wandb_entity: str = ""  # the W&B team or user; '' is W&B's default entity
    wandb_run_name: str = ""  # the W&B run's display name; '' is the workdir's basename
    wandb_tags: str = ""  # comma-separated W&B tags

    def __post_init__(self):
        _finite("logging", self)
        _positive("logging", self, "log_every", "peak_tflops")
        from nnx_zoo.training.profile import parse_steps

        parse_steps(self.profile_steps)  # one line naming the valid form
        for name in ("wandb_entity", "wandb_run_name", "wandb_tags"):
            if getattr(self, name) and not self.wandb_project:
                _fail("logging", name, getattr(self, name), "needs logging.wandb_project")

    def wandb_tag_list(self) -> list[str]:
        return [t.strip() for t in self.wandb_tags.split(",") if t.strip()]


@dataclasses.dataclass(frozen=True)
class LoraSection:
    rank: int | None = None  # LoRA rank r; None: no adapters, every parameter trains
    alpha: float = 16.0  # the adapters' update is scaled by alpha / r
    dropout: float = 0.0  # dropout on the adapters' input while training
    # Projections that get adapters, comma-separated: q_proj,k_proj,v_proj,o_proj,gate,up,down
    targets: str = "q_proj,k_proj,v_proj,o_proj"

    def __post_init__(self):
        _finite("lora", self)
        if self.rank is not None:
            self.lora_config()  # one-line UsageError for a bad rank, alpha, dropout or target

    @property
    def enabled(self) -> bool:
        return self.rank is not None

    def lora_config(self):
        """The zoo's LoraConfig (zoo/layers/lora.py), or None without adapters."""
        if self.rank is None:
            return None
        targets = tuple(t.strip() for t in self.targets.split(",") if t.strip())
        return LoraConfig(rank=self.rank, alpha=self.alpha, dropout=self.dropout, targets=targets)


@dataclasses.dataclass(frozen=True)
class EvalSection:
    # lm-evaluation-harness tasks run inside training (extra [eval]), comma-separated: the
    # harness's names or local ones under include_path (zoo_facts, zoo_prose: the shipped
    # examples). Scored on the run's own model, mesh and strategy, as eval_main --tasks
    # scores the checkpoint of the same step. '' runs none.
    tasks: str = ""
    every: int = 0  # run them every N steps (and at the end); 0: only at the end
    # Directory of local task YAML; lm_eval_tasks names the examples shipped with the package.
    include_path: str = "lm_eval_tasks"
    num_fewshot: int | None = None  # few-shot examples; None: each task's own
    limit: float | None = None  # examples per task: N, or a fraction when < 1; None: all
    seed: int = 0  # the draws of sampled generate_until tasks (eval_main's --seed)

    def __post_init__(self):
        _finite("eval", self)
        if self.every < 0:
            _fail("eval", "every", self.every, "must be >= 0 (0: only at the end)")
        if self.num_fewshot is not None and self.num_fewshot < 0:
            _fail("eval", "num_fewshot", self.num_fewshot, "must be >= 0")
        _positive("eval", self, "limit")
        if self.tasks and not self.task_names():
            _fail("eval", "tasks", self.tasks, "names no task; e.g. zoo_facts,zoo_prose")
        if not self.tasks:
            for name in ("every", "num_fewshot", "limit"):
                if getattr(self, name):
                    _fail("eval", name, getattr(self, name), "needs eval.tasks (the tasks to run)")

    def task_names(self) -> list[str]:
        return [t.strip() for t in self.tasks.split(",") if t.strip()]


def defaults() -> dict[str, dict[str, tuple[Any, str]]]:
    """section -> field -> (default, its type as annotated): what configs.base_config() lays
    out, so every default is written once, here."""
    return {
        section: {f.name: (f.default, f.type.replace(" ", "")) for f in dataclasses.fields(kind)}
        for section, kind in _SECTION_TYPES.items()
    }


def section_fields(section: str) -> list[str]:
    """The field names of a config section, sorted (for error messages)."""
    return sorted(f.name for f in dataclasses.fields(_SECTION_TYPES[section]))


_SECTION_TYPES = {
    "model": ModelSection,
    "data": DataSection,
    "optimizer": OptimizerSection,
    "training": TrainingSection,
    "checkpoint": CheckpointSection,
    "logging": LoggingSection,
    "lora": LoraSection,
    "eval": EvalSection,
}


@dataclasses.dataclass(frozen=True)
class RunConfig:
    name: str
    model: ModelSection
    data: DataSection
    optimizer: OptimizerSection
    training: TrainingSection
    checkpoint: CheckpointSection
    logging: LoggingSection
    lora: LoraSection = LoraSection()
    eval: EvalSection = EvalSection()

    def __post_init__(self):
        pairs, objective = self.data.format == "preference", self.training.objective
        if pairs != (objective != "sft"):
            _fail(
                "training",
                "objective",
                objective,
                "dpo, orpo and simpo train on data.format=preference"
                if not pairs
                else "data.format=preference trains with dpo, orpo or simpo",
            )
        if self.optimizer.name == "muon" and self.lora.enabled:
            _fail(
                "optimizer",
                "name",
                "muon",
                "Muon trains the base model's matrices, and with lora.rank set only the "
                "adapters train; use optimizer.name=adamw with LoRA",
            )
        k = self.optimizer.micro_batches
        if self.data.global_batch_size % k:
            _fail(
                "optimizer",
                "micro_batches",
                k,
                f"must divide data.global_batch_size={self.data.global_batch_size}",
            )
        limit = self.warmup_limit
        if self.optimizer.warmup_steps > limit:
            _fail(
                "optimizer",
                "warmup_steps",
                self.optimizer.warmup_steps,
                f"must be <= {limit} for a {self.optimizer.schedule} schedule of "
                f"{self.decay_steps} steps (training.steps, or optimizer.decay_steps when set)",
            )

    @property
    def decay_steps(self) -> int:
        """The schedule's length: the step its decay ends."""
        return self.optimizer.decay_steps or self.training.steps

    def schedule_args(self) -> dict[str, Any]:
        """The learning-rate schedule as `nnx_zoo.training.schedules.make_schedule` (and
        `describe`) take it."""
        o = self.optimizer
        return dict(
            kind=o.schedule,
            learning_rate=o.learning_rate,
            warmup_steps=o.warmup_steps,
            total_steps=self.decay_steps,
            end_learning_rate_ratio=o.end_learning_rate_ratio,
            decay_fraction=o.decay_fraction,
            decay_shape=o.decay_shape,
        )

    @property
    def warmup_limit(self) -> int:
        """The longest warmup the schedule takes (nnx_zoo/training/schedules.py)."""
        o = self.optimizer
        return max_warmup(o.schedule, self.decay_steps, o.decay_fraction)

    @classmethod
    def from_config_dict(
        cls, config: Mapping[str, Any], notes: list[str] | None = None
    ) -> RunConfig:
        """Typed config from a ConfigDict (or nested dict); one-line UsageError on a bad one.

        A warmup longer than the schedule takes (a preset's warmup of 20 with
        `--config.training.steps=1`, a smoke run) is clamped to the longest it takes
        (`fit_warmup`), and a line saying so is appended to `notes` (the entry point prints it
        as a warning)."""
        if not isinstance(config, Mapping) and not hasattr(config, "to_dict"):
            raise UsageError(
                f"the config is a {type(config).__name__}, not a ConfigDict: get_config() "
                "must return an ml_collections ConfigDict (see configs/tiny.py)"
            )
        raw = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        unknown = sorted(set(raw) - set(SECTIONS) - {"name"})
        if unknown:
            raise UsageError(
                f"config has unknown top-level fields {unknown}; valid: name, {', '.join(SECTIONS)}"
            )
        sections = {}
        for section, section_type in _SECTION_TYPES.items():
            values = dict(raw.get(section) or {})
            names = {f.name for f in dataclasses.fields(section_type)}
            extra = sorted(set(values) - names)
            if extra:
                raise UsageError(
                    f"config section {section!r} has unknown fields {extra}; "
                    f"valid: {', '.join(sorted(names))}"
                )
            for field in dataclasses.fields(section_type):
                if field.name in values:
                    values[field.name] = _coerce(section, field, values[field.name])
            sections[section] = section_type(**values)
        optimizer, note = fit_warmup(
            sections["optimizer"], sections["optimizer"].decay_steps or sections["training"].steps
        )
        if note and notes is not None:
            notes.append(note)
        sections["optimizer"] = optimizer
        return cls(name=str(raw.get("name", "run")), **sections)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict (for checkpoint metadata and the run record)."""
        return dataclasses.asdict(self)


def fit_warmup(optimizer: OptimizerSection, length: int) -> tuple[OptimizerSection, str | None]:
    """The optimizer section with its warmup cut to the longest a schedule of `length` steps
    takes (cosine and constant: one step at the peak after it; wsd: its decay window after
    it), and the line that says so (None when it fits)."""
    clamped = max_warmup(optimizer.schedule, length, optimizer.decay_fraction)
    if optimizer.warmup_steps <= clamped:
        return optimizer, None
    note = (
        f"optimizer.warmup_steps={optimizer.warmup_steps} does not fit a schedule of {length} "
        "steps (training.steps, or optimizer.decay_steps when set): "
        f"warming up for {clamped} steps instead (set --config.optimizer.warmup_steps to choose)"
    )
    return dataclasses.replace(optimizer, warmup_steps=clamped), note


def _coerce(section: str, field: dataclasses.Field, value: Any) -> Any:
    """Check a value against the field's annotation (strings, as `from __future__` leaves
    them); ints are accepted for floats. ml_collections already types overrides, so this
    catches config files that set a field to the wrong kind of value."""
    kind = field.type.replace(" ", "")
    optional = kind.endswith("|None")
    base = kind.removesuffix("|None")
    if value is None:
        if optional:
            return None
        _fail(section, field.name, value, f"must be a {base}, not None")
    if base == "bool":
        if not isinstance(value, bool):
            _fail(section, field.name, value, "must be True or False")
        return value
    if base == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            _fail(section, field.name, value, "must be an integer")
        return value
    if base == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            _fail(section, field.name, value, "must be a number")
        return float(value)  # finite or not: the section's _finite says
    if base == "str" and not isinstance(value, str):
        _fail(section, field.name, value, "must be a string")
    return value
