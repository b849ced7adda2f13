"""The Hugging Face format of a family: which checkpoint tensor holds which of our params
(with the layout change between them) and how config.json maps to our Config.

Each family's `params.py` declares an `HfFormat` from these pieces; its `__init__.py`
registers it with the family (zoo/registry.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Sequence

import numpy as np

from nnx_zoo.errors import UsageError
from zoo.hf_dequantize import check_quantization
from zoo.layers.config import RUNTIME_FIELDS, DecoderConfig
from zoo.layers.rope import YARN_ENTRIES
from zoo.registry import FAMILIES, Family, family_for_config

CONFIG_FILE = "config.json"
# Config fields never in config.json: how to run (RUNTIME_FIELDS), the vocab padding of a
# layout, and what the family derives from other fields.
_NOT_IN_CONFIG_JSON = (
    *RUNTIME_FIELDS,
    "padded_vocab_size",
    "layer_types",
    "global_every",
    "sliding_window",
)

# --- layout changes between a Hugging Face tensor and ours -------------------------------


@dataclasses.dataclass(frozen=True)
class Transform:
    """load(hf_array, our_shapes) -> our arrays (one layer's); save(*ours) -> the hf array."""

    load: Callable[[np.ndarray, Sequence[tuple[int, ...]]], tuple[np.ndarray, ...]]
    save: Callable[..., np.ndarray]


IDENTITY = Transform(load=lambda w, shapes: (w.reshape(shapes[0]),), save=lambda w: w)
# torch nn.Linear stores [out, in]. Ours read the residual on their first dim and split the
# output features into real dims: [M, N, D], [M, F], [M, V].
LINEAR_IN = Transform(
    load=lambda w, shapes: (w.T.reshape(shapes[0]),),
    save=lambda w: w.reshape(w.shape[0], -1).T,
)
# ... and ours that write the residual contract their leading dims: [N, D, M], [F, M].
LINEAR_OUT = Transform(
    load=lambda w, shapes: (w.T.reshape(shapes[0]),),
    save=lambda w: w.reshape(-1, w.shape[-1]).T,
)

# GPT-2's Conv1D is already [in, out]; a [N*D, M] out-projection only gets its head dims.
CONV1D_OUT = Transform(
    load=lambda w, shapes: (w.reshape(shapes[0]),),
    save=lambda w: w.reshape(-1, w.shape[-1]),
)


def fused_last_dim(lead_dims: int) -> Transform:
    """One HF tensor whose last dim concatenates several of ours (GPT-2's `c_attn` = q | k | v);
    the first `lead_dims` dims are shared ([M, 3*N*D] weight: 1, [3*N*D] bias: 0)."""

    def load(w, shapes):
        sizes = [math.prod(s[lead_dims:]) for s in shapes]
        parts = np.split(w, np.cumsum(sizes)[:-1], axis=-1)
        return tuple(p.reshape(s) for p, s in zip(parts, shapes, strict=True))

    def save(*ws):
        return np.concatenate([w.reshape(*w.shape[:lead_dims], -1) for w in ws], axis=-1)

    return Transform(load=load, save=save)


@dataclasses.dataclass(frozen=True)
class Rule:
    """One Hugging Face tensor <-> the param(s) of ours it holds.

    `hf` contains '{i}' for a per-layer tensor; `ours` are param paths without a layer index
    ('blocks/attention/q/weight': the stacked param, or layer i's when layers are a list).
    '{e}' as well: one tensor per expert, of a param whose (per-layer) leading dim is E, and
    `transform` maps one expert's slice.
    """

    hf: str
    ours: tuple[str, ...]
    transform: Transform = IDENTITY

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.hf

    @property
    def per_expert(self) -> bool:
        return "{e}" in self.hf


def rule(hf: str, *ours: str, transform: Transform = IDENTITY) -> Rule:
    return Rule(hf=hf, ours=ours, transform=transform)


# --- config.json ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class HfFormat:
    architectures: tuple[str, ...]  # config.json `architectures` we load
    model_types: tuple[str, ...]  # config.json `model_type`, when `architectures` is absent
    config_from_hf: Callable[[dict], dict]  # config.json -> our Config's fields
    config_to_hf: Callable[[DecoderConfig], dict]  # our Config -> config.json
    rules: Callable[[DecoderConfig], list[Rule]]
    # Tensors a checkpoint may hold that carry nothing we use (mask buffers, tied heads):
    # patterns, or cfg -> patterns when they depend on the config.
    ignored: tuple[str, ...] | Callable[[DecoderConfig], tuple[str, ...]] = ()
    # A prefix some checkpoints of the family omit (hub GPT-2: `h.0...`; v5: `transformer.h.0...`).
    optional_prefix: str = ""
    # Which checkpoint layers each of our layer stacks holds: cfg -> {stack: (first hf layer,
    # layers)}. None: one stack, `blocks`, holding all of them (DeepSeek-V3 has two:
    # `dense_blocks` then `blocks`).
    stacks: Callable[[DecoderConfig], dict[str, tuple[int, int]]] | None = None
    # The config.json `quantization_config.quant_method`s read (dequantized on load,
    # zoo/hf_dequantize.py); any other is refused.
    quantizations: tuple[str, ...] = ()
    # Tensors the checkpoint also stores under other names: cfg -> {a per-model rule's hf
    # name: its copies}. Export writes them; import reads the original alone (`ignored`
    # must name the copies). DeepSeek-V3's MTP layers keep the embedding and the LM head.
    copies: Callable[[DecoderConfig], dict[str, tuple[str, ...]]] | None = None

    def ignored_patterns(self, cfg: DecoderConfig) -> tuple[str, ...]:
        return self.ignored(cfg) if callable(self.ignored) else self.ignored

    def copied(self, cfg: DecoderConfig) -> dict[str, tuple[str, ...]]:
        return {} if self.copies is None else self.copies(cfg)

    def layer_stacks(self, cfg: DecoderConfig) -> dict[str, tuple[int, int]]:
        return {"blocks": (0, cfg.num_layers)} if self.stacks is None else self.stacks(cfg)


def _with_format() -> list[Family]:
    return [f for f in FAMILIES.values() if f.hf is not None]


def family_for_hf(hf: dict, where: str) -> Family:
    archs = hf.get("architectures") or []
    model_type = hf.get("model_type")
    for fam in _with_format():
        if any(a in fam.hf.architectures for a in archs):
            return fam
    if not archs:
        for fam in _with_format():
            if model_type in fam.hf.model_types:
                return fam
    supported = ", ".join(a for fam in _with_format() for a in fam.hf.architectures)
    found = ", ".join(archs) or f"model_type {model_type!r}"
    raise UsageError(f"{where}: unsupported architecture {found}; supported: {supported}")


def hf_format(cfg: DecoderConfig) -> HfFormat:
    fam = family_for_config(cfg)
    if fam.hf is None:
        raise UsageError(f"no Hugging Face format registered for {type(cfg).__name__}")
    return fam.hf


def rope_parameters(hf: dict, layer_type: str | None = None) -> dict:
    """The RoPE dict of config.json in transformers 5 form ({rope_type, rope_theta, ...}).

    transformers 5 writes `rope_parameters` (per layer type for Gemma 3); 4.x wrote top-level
    `rope_theta` and `rope_scaling` ({"rope_type"|"type": ..., "factor": ...} or null).
    """
    params = hf.get("rope_parameters")
    if params is not None:
        if layer_type is not None and isinstance(params.get(layer_type), dict):
            return dict(params[layer_type])
        return dict(params)
    scaling = dict(hf.get("rope_scaling") or {})
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    return {"rope_type": rope_type, "rope_theta": hf.get("rope_theta", 10_000.0), **scaling}


def rope_scaling(params: dict) -> tuple | None:
    """Our `rope_scaling` from a RoPE dict: None, (factor,) linear, Llama 3's 4-tuple or YaRN's
    5-tuple."""
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        return None
    if rope_type == "linear":
        return (float(params["factor"]),)
    if rope_type == "llama3":
        return (
            float(params["factor"]),
            float(params["low_freq_factor"]),
            float(params["high_freq_factor"]),
            int(params["original_max_position_embeddings"]),
        )
    if rope_type == "yarn":
        return yarn_scaling(params)
    raise UsageError(
        f"rope_type {rope_type!r} is not supported; supported: default, linear, llama3, yarn"
    )


def yarn_scaling(params: dict) -> tuple:
    """YaRN's 5-tuple (zoo/layers/rope.py) from a RoPE dict, with transformers' defaults
    (beta_fast 32, beta_slow 1, truncate true). An `attention_factor` or `mscale` other than
    what the factor implies is refused: the zoo derives the attention factor from it."""
    for key in ("attention_factor", "mscale", "mscale_all_dim"):
        if params.get(key) is not None:
            raise UsageError(
                f"yarn rope_parameters.{key}={params[key]} is not supported; the attention "
                "factor is derived from `factor` (0.1 ln(factor) + 1)"
            )
    return (
        float(params["factor"]),
        float(params.get("beta_fast") or 32.0),
        float(params.get("beta_slow") or 1.0),
        int(params["original_max_position_embeddings"]),
        bool(params.get("truncate", True)),
    )


def rope_to_hf(theta: float, scaling: tuple | None) -> dict:
    params = {"rope_type": "default", "rope_theta": float(theta)}
    if scaling is not None and len(scaling) == 1:
        params.update(rope_type="linear", factor=float(scaling[0]))
    elif scaling is not None and len(scaling) == YARN_ENTRIES:
        factor, beta_fast, beta_slow, original, truncate = scaling
        params.update(
            rope_type="yarn",
            factor=float(factor),
            beta_fast=float(beta_fast),
            beta_slow=float(beta_slow),
            original_max_position_embeddings=int(original),
            truncate=bool(truncate),
        )
    elif scaling is not None:
        factor, low, high, original = scaling
        params.update(
            rope_type="llama3",
            factor=float(factor),
            low_freq_factor=float(low),
            high_freq_factor=float(high),
            original_max_position_embeddings=int(original),
        )
    return params


def rope_to_legacy_hf(theta: float, scaling: tuple | None) -> dict:
    """transformers 4.x's top-level RoPE fields, written beside `rope_parameters` so that 4.x
    readers (which ignore `rope_parameters`) do not silently fall back to their defaults."""
    params = rope_to_hf(theta, scaling)
    theta = params.pop("rope_theta")
    return {"rope_theta": theta, "rope_scaling": None if scaling is None else params}


def read_hf_config(path: str) -> dict:
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.exists(config_path):
        raise UsageError(f"{path}: no {CONFIG_FILE}; not a Hugging Face checkpoint directory")
    try:
        with open(config_path) as f:
            hf = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"{config_path}: not JSON ({e})") from None
    if not isinstance(hf, dict):
        raise UsageError(f"{config_path}: not a JSON object")
    return hf


def read_config(path: str, **overrides) -> DecoderConfig:
    """Our Config of the checkpoint at `path` (runtime fields such as dtype from `overrides`)."""
    return family_and_config(path, overrides)[1]


def family_and_config(path: str, overrides: dict) -> tuple[Family, DecoderConfig]:
    hf = read_hf_config(path)
    where = os.path.join(path, CONFIG_FILE)
    fam = family_for_hf(hf, where)
    check_quantization(hf, fam.name, fam.hf.quantizations, where)
    try:
        fields = fam.hf.config_from_hf(hf)
    except KeyError as e:
        raise UsageError(f"{where}: no field {e}") from None
    except (ValueError, TypeError) as e:  # TypeError: int(None), float([1]) on a bad value
        raise UsageError(f"{where}: {e}") from None
    check_field_types(fam.config_cls, fields, where)
    fields.update(overrides)
    return fam, fam.config_cls(**fields)


def check_field_types(config_cls, fields: dict, where: str) -> None:
    """UsageError (one line) for a config.json value of the wrong kind for our Config field it
    fills ("64" for an integer, null for a number, a non-finite float): the checks a
    dataclass does not make, so such values fail here and not deep in a layer's init."""
    kinds = {f.name: str(f.type).replace(" ", "") for f in dataclasses.fields(config_cls)}
    for name, value in fields.items():
        kind = kinds.get(name, "")
        optional = kind.endswith("|None")
        base = kind.removesuffix("|None")
        if value is None:
            if optional or base not in ("int", "float", "bool", "str"):
                continue
            bad = "must not be null"
        elif base == "int":
            bad = None if type(value) is int else "must be an integer"
        elif base == "float":
            number = isinstance(value, int | float) and not isinstance(value, bool)
            bad = None if number and math.isfinite(value) else "must be a finite number"
        elif base == "bool":
            bad = None if isinstance(value, bool) else "must be true or false"
        elif base == "str":
            bad = None if isinstance(value, str) else "must be a string"
        else:
            continue
        if bad:
            raise UsageError(f"{where}: the value {json.dumps(value)} that sets {name} {bad}")


def config_to_hf(cfg: DecoderConfig) -> dict:
    """config.json for `cfg`; UsageError when its family's format cannot express a field."""
    fam = family_for_config(cfg)
    fmt = hf_format(cfg)
    hf = fmt.config_to_hf(cfg)
    back = fam.config_cls(**fmt.config_from_hf(hf))
    for field in dataclasses.fields(cfg):
        if field.name in _NOT_IN_CONFIG_JSON:
            continue
        if getattr(back, field.name) != getattr(cfg, field.name):
            raise UsageError(
                f"{type(cfg).__name__}.{field.name}={getattr(cfg, field.name)!r} cannot be "
                f"written as a {hf['architectures'][0]} config.json"
            )
    if back.layer_windows() != cfg.layer_windows():
        raise UsageError(
            f"{type(cfg).__name__}: per-layer windows {cfg.layer_windows()} cannot be written "
            f"as a {hf['architectures'][0]} config.json"
        )
    return hf
