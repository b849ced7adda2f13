"""The one registry of model families: each family folder's `__init__.py` registers its
config type, model class, presets and Hugging Face format here, and nothing else lists them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from zoo.layers.config import DecoderConfig


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    config_cls: type  # a frozen DecoderConfig subclass
    model_cls: type  # (cfg, LmSharding, *, rngs) -> the model
    presets: dict[str, Callable[..., DecoderConfig]]  # preset name -> factory(**overrides)
    hf: object | None = None  # its Hugging Face format (zoo.hf_mapping.HfFormat), if any


FAMILIES: dict[str, Family] = {}


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
        raise ValueError(
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
