"""The run config at the boundary: an ml_collections ConfigDict in, typed frozen dataclasses out.

`configs/*.py` hold the ConfigDicts (a comment on every field); `train_main.py` converts one
with `RunConfig.from_config_dict` right after flag parsing, and nothing past that point reads
the ConfigDict. Every check here raises ValueError with one line naming the field, its value
and what would be valid, so `main` can print it and exit with status 2.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

# zoo/layers/remat.py's names; repeated here so reading a config imports no JAX.
REMAT_POLICIES = ("none", "full", "dots", "save_qkv_proj", "save_out_proj", "offload")
QUANTIZATIONS = ("none", "fp8", "int8")  # zoo/layers/quant.py's
SECTIONS = ("model", "data", "optimizer", "training", "checkpoint", "logging")


def _fail(section: str, field: str, value: Any, why: str) -> None:
    raise ValueError(f"config {section}.{field}={value!r}: {why}")


def _positive(section: str, obj, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is not None and value <= 0:
            _fail(section, name, value, "must be > 0")


@dataclasses.dataclass(frozen=True)
class ModelSection:
    preset: str = "tiny"
    # None keeps the preset's value.
    vocab_size: int | None = None
    hidden_dim: int | None = None
    num_layers: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    ffn_dim: int | None = None
    max_seq_len: int | None = None
    dtype: str = "float32"
    scan_layers: bool = True
    scan_unroll: int = 0
    remat: str = "none"
    attention_impl: str = "xla"
    attention_interpret: bool = False
    quantization: str = "none"

    SHAPE_FIELDS = (
        "vocab_size",
        "hidden_dim",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "ffn_dim",
        "max_seq_len",
    )

    def __post_init__(self):
        _positive("model", self, *self.SHAPE_FIELDS)
        if self.scan_unroll < 0:
            _fail("model", "scan_unroll", self.scan_unroll, "valid: 0 (auto), 1 (rolled), or more")
        for name, valid in (
            ("dtype", ("float32", "bfloat16")),
            ("remat", REMAT_POLICIES),
            ("attention_impl", ("xla", "splash", "cudnn", "auto")),
            ("quantization", QUANTIZATIONS),
        ):
            if getattr(self, name) not in valid:
                _fail("model", name, getattr(self, name), f"valid: {', '.join(valid)}")

    def overrides(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.SHAPE_FIELDS if getattr(self, k) is not None}
        out.update(
            dtype=self.dtype,
            scan_layers=self.scan_layers,
            scan_unroll=self.scan_unroll,
            remat=self.remat,
            attention_impl=self.attention_impl,
            attention_interpret=self.attention_interpret,
            quantization=self.quantization,
        )
        return out

    def decoder_config(self):
        """The zoo's frozen model config: the preset with this section's overrides."""
        from zoo import get_config

        return get_config(self.preset, **self.overrides())


@dataclasses.dataclass(frozen=True)
class DataSection:
    source: str = "default"
    tokenizer: str = "byte"
    text_field: str = "text"
    seq_len: int = 128
    global_batch_size: int = 16
    num_workers: int = 0
    shuffle_seed: int = 0
    validation_fraction: float = 0.02

    def __post_init__(self):
        _positive("data", self, "seq_len", "global_batch_size")
        if self.num_workers < 0:
            _fail("data", "num_workers", self.num_workers, "must be >= 0")
        if not 0 < self.validation_fraction < 1:
            _fail("data", "validation_fraction", self.validation_fraction, "must be in (0, 1)")
        if not self.source:
            _fail("data", "source", self.source, "'default' or a path / directory / glob")


@dataclasses.dataclass(frozen=True)
class OptimizerSection:
    learning_rate: float = 3e-4
    warmup_steps: int = 0
    decay_steps: int | None = None  # None: training.steps
    end_learning_rate_ratio: float = 0.1
    weight_decay: float = 0.1
    clip_grad_norm: float = 1.0
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    micro_batches: int = 1
    decay_norms_and_embeddings: bool = False

    def __post_init__(self):
        _positive("optimizer", self, "learning_rate", "micro_batches", "eps", "decay_steps")
        if self.warmup_steps < 0:
            _fail("optimizer", "warmup_steps", self.warmup_steps, "must be >= 0")
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


@dataclasses.dataclass(frozen=True)
class TrainingSection:
    steps: int = 100
    seed: int = 0
    sharding_strategy: str = "fsdp_tp"
    mesh_shape: str = ""  # '' = the strategy's default for the devices
    eval_every: int = 0  # 0 = only at the end
    eval_batches: int = 4
    loss_chunk_size: int = 1024  # tokens per device per chunk of the fused LM head + loss; 0: off

    def __post_init__(self):
        _positive("training", self, "steps", "eval_batches")
        if self.loss_chunk_size < 0:
            _fail(
                "training",
                "loss_chunk_size",
                self.loss_chunk_size,
                "must be >= 0 (tokens per device per loss chunk; 0: full logits)",
            )
        if self.eval_every < 0:
            _fail("training", "eval_every", self.eval_every, "must be >= 0 (0: only at the end)")


@dataclasses.dataclass(frozen=True)
class CheckpointSection:
    enabled: bool = True
    every: int = 100
    keep: int = 3
    async_save: bool = True

    def __post_init__(self):
        _positive("checkpoint", self, "every", "keep")


@dataclasses.dataclass(frozen=True)
class LoggingSection:
    log_every: int = 10
    peak_tflops: float | None = None  # None: table lookup, or measured on CPU
    progress_bar: bool = True

    def __post_init__(self):
        _positive("logging", self, "log_every", "peak_tflops")


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

    def __post_init__(self):
        k = self.optimizer.micro_batches
        if self.data.global_batch_size % k:
            _fail(
                "optimizer",
                "micro_batches",
                k,
                f"must divide data.global_batch_size={self.data.global_batch_size}",
            )
        # The cosine decay after the warmup needs at least one step.
        if self.optimizer.warmup_steps >= self.decay_steps:
            _fail(
                "optimizer",
                "warmup_steps",
                self.optimizer.warmup_steps,
                f"must be < the schedule length ({self.decay_steps} steps: training.steps, "
                "or optimizer.decay_steps when set)",
            )

    @property
    def decay_steps(self) -> int:
        return self.optimizer.decay_steps or self.training.steps

    @classmethod
    def from_config_dict(cls, config: Mapping[str, Any]) -> RunConfig:
        """Typed config from a ConfigDict (or nested dict); one-line ValueError on a bad one."""
        raw = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        unknown = sorted(set(raw) - set(SECTIONS) - {"name"})
        if unknown:
            raise ValueError(
                f"config has unknown top-level fields {unknown}; valid: name, {', '.join(SECTIONS)}"
            )
        sections = {}
        for section, section_type in _SECTION_TYPES.items():
            values = dict(raw.get(section) or {})
            names = {f.name for f in dataclasses.fields(section_type)}
            extra = sorted(set(values) - names)
            if extra:
                raise ValueError(
                    f"config section {section!r} has unknown fields {extra}; "
                    f"valid: {', '.join(sorted(names))}"
                )
            for field in dataclasses.fields(section_type):
                if field.name in values:
                    values[field.name] = _coerce(section, field, values[field.name])
            sections[section] = section_type(**values)
        return cls(name=str(raw.get("name", "run")), **sections)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able dict (for checkpoint metadata and the run record)."""
        return dataclasses.asdict(self)


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
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            _fail(section, field.name, value, "must be a number")
        return float(value)
    if base == "str" and not isinstance(value, str):
        _fail(section, field.name, value, "must be a string")
    return value
