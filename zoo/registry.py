"""The one registry of model families: each family folder's `__init__.py` registers its
config type, model class, presets and Hugging Face format here, and nothing else lists them."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping

from nnx_zoo.errors import UsageError
from zoo.layers.config import DecoderConfig


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    config_cls: type  # a frozen DecoderConfig subclass
    model_cls: type  # (cfg, LmSharding, *, rngs) -> the model
    presets: dict[str, Callable[..., DecoderConfig]]  # preset name -> factory(**overrides)
    hf: object | None = None  # its Hugging Face format (zoo.hf_mapping.HfFormat), if any


FAMILIES: dict[str, Family] = {}

# A preset row's columns, in order: V M L N K D F and the context length T.
PRESET_DIMS = (
    "vocab_size",
    "hidden_dim",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "ffn_dim",
    "max_seq_len",
)


def experts(count: int, top_k: int, ffn_dim: int) -> dict:
    """A mixture-of-experts preset's other fields: E experts, top k per token, each expert's F."""
    return {"num_experts": count, "num_experts_per_tok": top_k, "moe_ffn_dim": ffn_dim}


def _from_row(config_cls: type, fields: dict, **overrides) -> DecoderConfig:
    return config_cls(**{**fields, **overrides})


def preset_table(
    config_cls: type, rows: Mapping[str, tuple]
) -> dict[str, Callable[..., DecoderConfig]]:
    """A family's presets from one table: preset name -> (the `PRESET_DIMS` in order, then
    optionally a dict of the preset's other fields). Gives preset name -> factory(**overrides),
    what `Family.presets` holds; overrides win over the row."""
    table = {}
    for name, row in rows.items():
        dims, extra = (row[:-1], row[-1]) if isinstance(row[-1], Mapping) else (row, {})
        if len(dims) != len(PRESET_DIMS):
            raise UsageError(
                f"preset {name!r} has {len(dims)} dims; a row holds {', '.join(PRESET_DIMS)}"
            )
        fields = {**dict(zip(PRESET_DIMS, dims, strict=True)), **extra}
        table[name] = functools.partial(_from_row, config_cls, fields)
    return table


def register(family: Family) -> Family:
    """Add `family`; a name or preset already taken by another family is an error."""
    if family.name in FAMILIES:
        raise ValueError(f"model family {family.name!r} is registered twice")
    taken = {p: f.name for f in FAMILIES.values() for p in f.presets}
    for preset in family.presets:
        if preset in taken:
            raise ValueError(f"preset {preset!r} of {family.name!r} is {taken[preset]!r}'s")
    FAMILIES[family.name] = family
    return family


def presets() -> dict[str, Callable[..., DecoderConfig]]:
    return {p: factory for f in FAMILIES.values() for p, factory in f.presets.items()}


def get_config(name: str, **overrides) -> DecoderConfig:
    factories = presets()
    if name not in factories:
        raise UsageError(
            f"unknown model preset {name!r}; valid presets: {', '.join(sorted(factories))}"
        )
    return factories[name](**overrides)


def family_for_config(cfg: DecoderConfig) -> Family:
    """The family of `cfg`'s type (or of its nearest registered base type)."""
    by_type = {f.config_cls: f for f in FAMILIES.values()}
    for config_type in type(cfg).__mro__:
        if config_type in by_type:
            return by_type[config_type]
    raise ValueError(f"no model family registered for {type(cfg).__name__}")


def config_types() -> dict[str, type]:
    """Config type name -> type, for configs recorded by name (run_info.json)."""
    return {f.config_cls.__name__: f.config_cls for f in FAMILIES.values()}
