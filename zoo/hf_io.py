"""Hugging Face checkpoint directories <-> zoo models, loaded straight into their shardings.

A checkpoint directory holds `config.json` and the weights as `model.safetensors`, or as
shards listed by `model.safetensors.index.json` (zoo/safetensors_io.py reads and writes
those). Each family declares its `HfFormat` (zoo/hf_mapping.py): how its config.json maps to
our Config, and a list of `Rule`s, each pairing one Hugging Face tensor with the param(s) of
ours it holds and the layout change between them.

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
import json
import os
import re
import shutil
import tempfile

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zoo.hf_mapping import (
    CONFIG_FILE,
    Rule,
    config_to_hf,
    family_and_config,
    hf_format,
    read_config,
    read_hf_config,
)
from zoo.layers.config import DecoderConfig
from zoo.registry import Family
from zoo.safetensors_io import (
    DEFAULT_MAX_SHARD_BYTES,
    INDEX_FILE,
    SINGLE_FILE,
    CheckpointReader,
    ShardWriter,
)

# The public surface for checkpoint directories, whichever module implements each part.
__all__ = [
    "CONFIG_FILE",
    "DEFAULT_MAX_SHARD_BYTES",
    "INDEX_FILE",
    "SINGLE_FILE",
    "CheckpointReader",
    "config_to_hf",
    "from_pretrained",
    "read_config",
    "read_hf_config",
    "save_pretrained",
]

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
    rules = fam.hf.rules(cfg)
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

    prefix = fam.hf.optional_prefix
    present = {}
    for name in reader.names():
        canonical = name if not prefix or name.startswith(prefix) else prefix + name
        present[canonical] = name
    missing = [n for n in expected if n not in present]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"missing tensor {missing[0]}{more} in {fam.name} checkpoint {reader}")
    ignored = [re.compile(p) for p in fam.hf.ignored]
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
    from zoo.build import check_model_fits

    if isinstance(strategy, str):
        strategy = get_strategy(strategy)
    fam, cfg = family_and_config(path, overrides)
    mesh = _concrete_mesh(mesh)
    check_model_fits(cfg, strategy, mesh)
    reader = CheckpointReader(path)
    cls = fam.model_cls
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
    fmt = hf_format(cfg)
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
        for r in fmt.rules(cfg):
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
