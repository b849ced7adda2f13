"""Hugging Face checkpoint directories <-> zoo models, loaded straight into their shardings.

A checkpoint directory holds `config.json` and the weights as `model.safetensors`, or as
shards listed by `model.safetensors.index.json`. Each family's `params.py` registers a
`Family`: how its config.json maps to our Config, and a list of `Rule`s, each pairing one
Hugging Face tensor with the param(s) of ours it holds and the layout change between them.

Loading (`from_pretrained`) checks every name and shape from the safetensors headers first,
then builds the model abstractly under the target mesh and fills one param at a time: the
host reads that param's tensors (one layer's tensor at a time, stacked over layers), and
`jax.make_array_from_callback` hands each device only its slice of the declared layout. So the
host holds one param and no device ever holds more than its shard.

Saving (`save_pretrained`) gathers one param at a time to the host, writes shards of at most
`max_shard_bytes` (with an index when there are several) into a temporary directory, and
renames it into place: a reader never sees half a checkpoint.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import os
import re
import shutil
import struct
import tempfile
from collections.abc import Callable, Sequence

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors.numpy import save_file

from zoo.layers.config import DecoderConfig

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Where each family's `FAMILY` lives; imported on first use (they import this module).
FAMILY_MODULES = (
    "zoo.llama.params",
    "zoo.qwen3.params",
    "zoo.mistral.params",
    "zoo.gemma3.params",
    "zoo.gpt2.params",
)
# Config fields that say how to run a model, not what it is: never in config.json.
RUNTIME_FIELDS = ("dtype", "scan_layers", "remat", "attention_impl", "attention_interpret")
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30  # Hugging Face's default shard size

# --- safetensors, one tensor at a time --------------------------------------------------------

# safetensors' numpy reader rejects BF16 (numpy has no bfloat16), the dtype most hub
# checkpoints use; the format is a JSON header and raw little-endian bytes, read here directly.
_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


class SafetensorsFile:
    """Names, shapes and dtypes from the header; `read(name)` reads that tensor's bytes only."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        header.pop("__metadata__", None)
        self._data_start = 8 + header_len
        self._entries = header

    def names(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entries[name]["shape"])

    def dtype(self, name: str) -> str:
        return self._entries[name]["dtype"]

    def read(self, name: str) -> np.ndarray:
        entry = self._entries[name]
        if entry["dtype"] not in _DTYPES:
            raise ValueError(f"{name}: unsupported safetensors dtype {entry['dtype']}")
        start, end = entry["data_offsets"]
        with open(self.path, "rb") as f:
            f.seek(self._data_start + start)
            data = f.read(end - start)
        return np.frombuffer(data, _DTYPES[entry["dtype"]]).reshape(entry["shape"])


class CheckpointReader:
    """Every tensor of a checkpoint directory, single-file or sharded with an index."""

    def __init__(self, directory: str):
        self.directory = str(directory)
        index_path = os.path.join(directory, INDEX_FILE)
        single_path = os.path.join(directory, SINGLE_FILE)
        if os.path.exists(index_path):
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
            files = {
                shard: SafetensorsFile(os.path.join(directory, shard))
                for shard in sorted(set(weight_map.values()))
            }
            self._file_of = {name: files[shard] for name, shard in weight_map.items()}
        elif os.path.exists(single_path):
            single = SafetensorsFile(single_path)
            self._file_of = dict.fromkeys(single.names(), single)
        else:
            raise ValueError(f"{directory}: no {SINGLE_FILE} or {INDEX_FILE}")

    def __str__(self) -> str:
        return self.directory

    def names(self) -> list[str]:
        return list(self._file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._file_of[name].shape(name)

    def dtype(self, name: str) -> str:
        return self._file_of[name].dtype(name)

    def read(self, name: str) -> np.ndarray:
        return self._file_of[name].read(name)


class ShardWriter:
    """Adds tensors in order; writes a shard whenever the next one would pass the limit."""

    def __init__(self, directory: str, max_shard_bytes: int):
        self.directory = directory
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, np.ndarray] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []
        self.total_bytes = 0

    def add(self, name: str, array: np.ndarray) -> None:
        if self._pending and self._pending_bytes + array.nbytes > self.max_shard_bytes:
            self._flush()
        self._pending[name] = np.ascontiguousarray(array)
        self._pending_bytes += array.nbytes
        self.total_bytes += array.nbytes

    def _flush(self) -> None:
        path = os.path.join(self.directory, f"shard-{len(self._shards)}.tmp")
        # 'pt' is what transformers' loader expects in the metadata of a safetensors file.
        save_file(self._pending, path, metadata={"format": "pt"})
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def finish(self) -> None:
        if self._pending or not self._shards:
            self._flush()
        n = len(self._shards)
        if n == 1:
            os.rename(
                os.path.join(self.directory, "shard-0.tmp"),
                os.path.join(self.directory, SINGLE_FILE),
            )
            return
        weight_map = {}
        for k, names in enumerate(self._shards):
            shard = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
            os.rename(
                os.path.join(self.directory, f"shard-{k}.tmp"), os.path.join(self.directory, shard)
            )
            weight_map.update(dict.fromkeys(names, shard))
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        with open(os.path.join(self.directory, INDEX_FILE), "w") as f:
            json.dump(index, f, indent=2)


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
    """

    hf: str
    ours: tuple[str, ...]
    transform: Transform = IDENTITY

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.hf


def rule(hf: str, *ours: str, transform: Transform = IDENTITY) -> Rule:
    return Rule(hf=hf, ours=ours, transform=transform)


# --- config.json ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    config_cls: type
    architectures: tuple[str, ...]  # config.json `architectures` we load
    model_types: tuple[str, ...]  # config.json `model_type`, when `architectures` is absent
    config_from_hf: Callable[[dict], dict]  # config.json -> our Config's fields
    config_to_hf: Callable[[DecoderConfig], dict]  # our Config -> config.json
    rules: Callable[[DecoderConfig], list[Rule]]
    # Tensors a checkpoint may hold that carry nothing we use (mask buffers, tied heads).
    ignored: tuple[str, ...] = ()
    # A prefix some checkpoints of the family omit (hub GPT-2: `h.0...`; v5: `transformer.h.0...`).
    optional_prefix: str = ""


def families() -> list[Family]:
    return [importlib.import_module(m).FAMILY for m in FAMILY_MODULES]


def family_for_hf(hf: dict, where: str) -> Family:
    archs = hf.get("architectures") or []
    model_type = hf.get("model_type")
    for fam in families():
        if any(a in fam.architectures for a in archs):
            return fam
    if not archs:
        for fam in families():
            if model_type in fam.model_types:
                return fam
    supported = ", ".join(a for fam in families() for a in fam.architectures)
    found = ", ".join(archs) or f"model_type {model_type!r}"
    raise ValueError(f"{where}: unsupported architecture {found}; supported: {supported}")


def family_for_config(cfg: DecoderConfig) -> Family:
    by_type = {fam.config_cls: fam for fam in families()}
    for config_type in type(cfg).__mro__:
        if config_type in by_type:
            return by_type[config_type]
    raise ValueError(f"no Hugging Face format registered for {type(cfg).__name__}")


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
    """Our `rope_scaling` from a RoPE dict: None, (factor,) linear, or Llama 3's 4-tuple."""
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
    raise ValueError(
        f"rope_type {rope_type!r} is not supported; supported: default, linear, llama3"
    )


def rope_to_hf(theta: float, scaling: tuple | None) -> dict:
    params = {"rope_type": "default", "rope_theta": float(theta)}
    if scaling is not None and len(scaling) == 1:
        params.update(rope_type="linear", factor=float(scaling[0]))
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
        raise ValueError(f"{path}: no {CONFIG_FILE}; not a Hugging Face checkpoint directory")
    with open(config_path) as f:
        return json.load(f)


def read_config(path: str, **overrides) -> DecoderConfig:
    """Our Config of the checkpoint at `path` (runtime fields such as dtype from `overrides`)."""
    return _family_and_config(path, overrides)[1]


def _family_and_config(path: str, overrides: dict) -> tuple[Family, DecoderConfig]:
    hf = read_hf_config(path)
    where = os.path.join(path, CONFIG_FILE)
    fam = family_for_hf(hf, where)
    try:
        fields = fam.config_from_hf(hf)
    except (KeyError, ValueError) as e:
        what = f"no field {e}" if isinstance(e, KeyError) else str(e)
        raise ValueError(f"{where}: {what}") from None
    fields.update(overrides)
    return fam, fam.config_cls(**fields)


def config_to_hf(cfg: DecoderConfig) -> dict:
    """config.json for `cfg`; ValueError when its family's format cannot express a field."""
    fam = family_for_config(cfg)
    hf = fam.config_to_hf(cfg)
    back = fam.config_cls(**fam.config_from_hf(hf))
    for field in dataclasses.fields(cfg):
        if field.name in (*RUNTIME_FIELDS, "layer_types", "global_every", "sliding_window"):
            continue
        if getattr(back, field.name) != getattr(cfg, field.name):
            raise ValueError(
                f"{type(cfg).__name__}.{field.name}={getattr(cfg, field.name)!r} cannot be "
                f"written as a {hf['architectures'][0]} config.json"
            )
    if back.layer_windows() != cfg.layer_windows():
        raise ValueError(
            f"{type(cfg).__name__}: per-layer windows {cfg.layer_windows()} cannot be written "
            f"as a {hf['architectures'][0]} config.json"
        )
    return hf


# --- the mapping between checkpoint tensors and our params -----------------------------------


def _param_key(path: tuple) -> tuple[str, int | None]:
    """('blocks', 3, 'mlp', ...) -> ('blocks/mlp/...', 3); stacked or global -> (path, None)."""
    parts = [str(p) for p in path]
    if len(parts) > 1 and parts[0] == "blocks" and isinstance(path[1], int):
        return "/".join([parts[0], *parts[2:]]), path[1]
    return "/".join(parts), None


@dataclasses.dataclass
class _Plan:
    """Which checkpoint tensor (its name there) feeds each of our params, checked up front."""

    rules: dict[str, tuple[Rule, int]]  # our key -> (rule, index into rule.ours)
    shapes: dict[str, tuple[int, ...]]  # our key -> one layer's shape
    names: dict[str, str]  # canonical HF name -> name in the checkpoint
    num_layers: int

    def hf_name(self, r: Rule, layer: int | None) -> str:
        return self.names[r.hf.format(i=layer)] if r.per_layer else self.names[r.hf]


def _our_shapes(flat) -> dict[str, tuple[int, ...]]:
    """Our key -> one layer's shape (stacked params lose their leading L)."""
    shapes = {}
    for var_path, var in flat:
        key, layer = _param_key(var_path)
        shape = tuple(var.get_value().shape)
        stacked = key.startswith("blocks/") and layer is None
        shapes[key] = shape[1:] if stacked else shape
    return shapes


def _expected_hf_shape(r: Rule, our_shapes) -> tuple[int, ...]:
    # `save` applied to zero-stride arrays: views only, so even a [V, M] table costs nothing.
    zeros = [np.broadcast_to(np.zeros((), np.float32), s) for s in our_shapes]
    return tuple(r.transform.save(*zeros).shape)


def _plan(fam: Family, cfg: DecoderConfig, reader: CheckpointReader, shapes: dict) -> _Plan:
    """Checks the checkpoint against the model: every tensor present, of the right shape,
    and nothing left over."""
    rules = fam.rules(cfg)
    by_key = {}
    for r in rules:
        for j, key in enumerate(r.ours):
            if r.per_layer != key.startswith("blocks/"):
                raise ValueError(f"{fam.name}: rule {r.hf} and param {key} disagree on layers")
            by_key[key] = (r, j)
    unmapped = sorted(set(shapes) - set(by_key))
    if unmapped:
        raise ValueError(f"{fam.name}: no checkpoint tensor maps to param {unmapped[0]}")
    unused = sorted(set(by_key) - set(shapes))
    if unused:
        raise ValueError(f"{fam.name}: rule for {unused[0]}, which this config does not create")

    expected = {}  # canonical HF name -> expected shape
    for r in rules:
        shape = _expected_hf_shape(r, [shapes[k] for k in r.ours])
        for i in range(cfg.num_layers) if r.per_layer else [None]:
            expected[r.hf.format(i=i)] = shape

    prefix = fam.optional_prefix
    present = {}
    for name in reader.names():
        canonical = name if not prefix or name.startswith(prefix) else prefix + name
        present[canonical] = name
    missing = [n for n in expected if n not in present]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"missing tensor {missing[0]}{more} in {fam.name} checkpoint {reader}")
    ignored = [re.compile(p) for p in fam.ignored]
    unexpected = [
        actual
        for canonical, actual in present.items()
        if canonical not in expected and not any(p.fullmatch(actual) for p in ignored)
    ]
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise ValueError(
            f"unexpected tensor {unexpected[0]}{more} in {fam.name} checkpoint {reader}"
        )
    for canonical, shape in expected.items():
        actual = present[canonical]
        found = reader.shape(actual)
        if found != shape:
            raise ValueError(f"{actual}: expected shape {shape}, found {found}")
        dtype = reader.dtype(actual)
        if dtype not in ("F64", "F32", "F16", "BF16"):
            raise ValueError(f"{actual}: expected a floating-point tensor, found {dtype}")
    return _Plan(rules=by_key, shapes=shapes, names=present, num_layers=cfg.num_layers)


def _host_param(plan: _Plan, reader: CheckpointReader, key, layer, shape) -> np.ndarray:
    """Our param as float32 on the host: stacked over layers when it is (`layer` None)."""
    r, j = plan.rules[key]
    # A fused tensor is split into all of its params' shapes; we keep the j-th.
    shapes = [plan.shapes[k] for k in r.ours]

    def one(i):
        w = reader.read(plan.hf_name(r, i)).astype(np.float32)
        return r.transform.load(w, shapes)[j]

    if not r.per_layer or layer is not None:
        return np.ascontiguousarray(one(layer), np.float32)
    out = np.empty(shape, np.float32)
    for i in range(plan.num_layers):
        out[i] = one(i)
    return out


# --- from_pretrained / save_pretrained ---------------------------------------------------


def _concrete_mesh(mesh):
    if mesh is not None:
        return mesh
    mesh = jax.sharding.get_mesh()
    if mesh is None or mesh.empty:
        raise ValueError(
            "from_pretrained needs a mesh: pass mesh= or call it under `with jax.set_mesh(mesh):`"
        )
    return mesh


def from_pretrained(path: str, strategy, *, mesh=None, **overrides):
    """The model of the Hugging Face checkpoint directory `path`, laid out by `strategy`.

    `strategy`: a Strategy or its name. `mesh`: default the active one (`jax.set_mesh`).
    `overrides`: Config fields, e.g. runtime ones (dtype='bfloat16', remat='full',
    scan_layers=False, attention_impl='auto', max_seq_len=...). Parameters are float32.
    Raises ValueError (one line) for an unsupported architecture or a checkpoint whose
    tensors are missing, misshapen or unexpected, before any device memory is used.
    """
    from shardings.strategies import get_strategy
    from zoo.build import check_model_fits, model_class

    if isinstance(strategy, str):
        strategy = get_strategy(strategy)
    fam, cfg = _family_and_config(path, overrides)
    mesh = _concrete_mesh(mesh)
    check_model_fits(cfg, strategy, mesh)
    reader = CheckpointReader(path)
    cls = model_class(cfg)
    sharding = strategy.lm_sharding()
    with jax.set_mesh(mesh):
        abstract = nnx.eval_shape(lambda: cls(cfg, sharding, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    flat = nnx.to_flat_state(state)
    for var_path, var in flat:
        if not isinstance(var, nnx.Param):
            name = "/".join(map(str, var_path))
            raise ValueError(f"{name}: a {type(var).__name__}, which no checkpoint holds")
    plan = _plan(fam, cfg, reader, _our_shapes(flat))

    for var_path, var in flat:
        key, layer = _param_key(var_path)
        shape = tuple(var.get_value().shape)
        spec = P(*(var.get_metadata().get("out_sharding") or ()))
        host = _host_param(plan, reader, key, layer, shape)
        array = jax.make_array_from_callback(
            shape, NamedSharding(mesh, spec), lambda index, host=host: host[index]
        )
        var.set_value(array)
        del host
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _to_host(x) -> np.ndarray:
    if x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def save_pretrained(model, path: str, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
    """Write `model` as a Hugging Face checkpoint directory (config.json + safetensors).

    Every process must call it (gathering a param spread over processes is a collective);
    process 0 writes. The directory appears whole or not at all (written aside, then renamed);
    an existing one at `path` is replaced.
    """
    cfg = model.cfg
    fam = family_for_config(cfg)
    hf_config = config_to_hf(cfg)
    params = {}
    for var_path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        key, layer = _param_key(var_path)
        params.setdefault(key, {})[layer] = var.get_value()
    writer_process = jax.process_index() == 0
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    tmp = None
    if writer_process:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=os.path.basename(path) + ".tmp-", dir=parent)
        writer = ShardWriter(tmp, max_shard_bytes)
    try:
        for r in fam.rules(cfg):
            ours = [_gather(params[k]) for k in r.ours]  # per layer: a list, else one array
            if not writer_process:
                continue
            if r.per_layer:
                for i in range(cfg.num_layers):
                    writer.add(r.hf.format(i=i), r.transform.save(*[o[i] for o in ours]))
            else:
                writer.add(r.hf, r.transform.save(*ours))
            del ours
        if writer_process:
            writer.finish()
            with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
                json.dump(hf_config, f, indent=2, sort_keys=True)
            _replace_dir(tmp, path)
            tmp = None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(f"save_pretrained {path}")


def _gather(by_layer: dict):
    """A param on the host: stacked [L, ...] (indexable per layer) or a list of layers."""
    if None in by_layer:
        return _to_host(by_layer[None])
    return [_to_host(by_layer[i]) for i in sorted(by_layer)]


def _replace_dir(tmp: str, path: str) -> None:
    # mkdtemp (and the safetensors writer) make files private to us; give them the modes
    # of ordinary files under the caller's umask.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    for name in os.listdir(tmp):
        os.chmod(os.path.join(tmp, name), 0o666 & ~umask)
    if not os.path.exists(path):
        os.rename(tmp, path)
        return
    old = tempfile.mkdtemp(prefix=os.path.basename(path) + ".old-", dir=os.path.dirname(path))
    os.rmdir(old)
    os.rename(path, old)
    os.rename(tmp, path)
    shutil.rmtree(old)
