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
host holds one param and no device ever holds more than its shard. Mixture-of-experts
weights, one tensor per expert in the checkpoint and stacked on an E dim here, are read per
shard instead: each device's callback reads only the layers and experts of its slice, so with
experts split over devices no host ever holds all of them.

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

from nnx_zoo.errors import UsageError
from zoo.hf_dequantize import dequantizing_reader
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
from zoo.layers.decoder import VOCAB_DIMS
from zoo.plan import ModelPlan, plan_model
from zoo.registry import Family, family_for_config
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


def _is_stack(name: str) -> bool:
    """Whether a top-level name is a layer stack: `blocks`, or another `*_blocks`."""
    return name == "blocks" or name.endswith("_blocks")


def _stack_of(key: str) -> str | None:
    first = key.split("/", 1)[0]
    return first if _is_stack(first) and "/" in key else None


def _param_key(path: tuple) -> tuple[str, int | None]:
    """('blocks', 3, 'mlp', ...) -> ('blocks/mlp/...', 3); stacked or global -> (path, None)."""
    parts = [str(p) for p in path]
    if len(parts) > 1 and _is_stack(parts[0]) and isinstance(path[1], int):
        return "/".join([parts[0], *parts[2:]]), path[1]
    return "/".join(parts), None


@dataclasses.dataclass
class _Plan:
    """Which checkpoint tensor (its name there) feeds each of our params, checked up front."""

    rules: dict[str, tuple[Rule, int]]  # our key -> (rule, index into rule.ours)
    shapes: dict[str, tuple[int, ...]]  # our key -> one layer's shape
    names: dict[str, str]  # canonical HF name -> name in the checkpoint
    stacks: dict[str, tuple[int, int]]  # our layer stack -> (its first hf layer, its layers)

    def layers(self, key: str) -> range:
        """The hf layers our stacked param `key` holds, in its order."""
        first, count = self.stacks[_stack_of(key)]
        return range(first, first + count)

    def hf_name(self, r: Rule, layer: int | None, expert: int | None = None) -> str:
        if r.per_expert:
            return self.names[r.hf.format(i=layer, e=expert)]
        return self.names[r.hf.format(i=layer)] if r.per_layer else self.names[r.hf]


def _on_file(key: str, shape: tuple[int, ...], cfg: DecoderConfig) -> tuple[int, ...]:
    """Our param `key`'s shape as a checkpoint holds it: a padded vocab dim
    (cfg.padded_vocab_size) at the true V. Hugging Face files always carry the true V."""
    dim = VOCAB_DIMS.get(key)
    if dim is None or cfg.vocab_rows == cfg.vocab_size:
        return shape
    return (*shape[:dim], cfg.vocab_size, *shape[dim + 1 :])


def _drop_vocab_padding(key: str, x: np.ndarray, cfg: DecoderConfig) -> np.ndarray:
    """Our param `key` with its padded vocab dim (if any) cut back to the true V."""
    dim = VOCAB_DIMS.get(key)
    if dim is None or cfg.vocab_rows == cfg.vocab_size:
        return x
    return x[(slice(None),) * dim + (slice(cfg.vocab_size),)]


def _our_shapes(flat, cfg: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """Our key -> one layer's shape as the checkpoint holds it (stacked params lose their
    leading L; a padded vocab dim is the true V)."""
    shapes = {}
    for var_path, var in flat:
        key, layer = _param_key(var_path)
        shape = tuple(var.get_value().shape)
        stacked = _stack_of(key) is not None and layer is None
        shapes[key] = _on_file(key, shape[1:] if stacked else shape, cfg)
    return shapes


def _expected_hf_shape(r: Rule, our_shapes) -> tuple[int, ...]:
    # `save` applied to zero-stride arrays: views only, so even a [V, M] table costs nothing.
    zeros = [np.broadcast_to(np.zeros((), np.float32), s) for s in our_shapes]
    return tuple(r.transform.save(*zeros).shape)


def _plan(fam: Family, cfg: DecoderConfig, reader: CheckpointReader, shapes: dict) -> _Plan:
    """Checks the checkpoint against the model: every tensor present, of the right shape,
    and nothing left over."""
    rules = fam.hf.rules(cfg)
    stacks = fam.hf.layer_stacks(cfg)
    by_key = {}
    for r in rules:
        for j, key in enumerate(r.ours):
            if r.per_layer != (_stack_of(key) in stacks):
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
        if r.per_expert:
            num_experts = shapes[r.ours[0]][0]
            shape = _expected_hf_shape(r, [shapes[k][1:] for k in r.ours])
            first = stacks[_stack_of(r.ours[0])][0]
            _check_expert_count(r, reader, num_experts, fam.name, first)
            for i in _layer_range(stacks, r.ours[0]):
                for e in range(num_experts):
                    expected[r.hf.format(i=i, e=e)] = shape
            continue
        shape = _expected_hf_shape(r, [shapes[k] for k in r.ours])
        for i in _layer_range(stacks, r.ours[0]) if r.per_layer else [None]:
            expected[r.hf.format(i=i)] = shape

    prefix = fam.hf.optional_prefix
    present = {}
    for name in reader.names():
        canonical = name if not prefix or name.startswith(prefix) else prefix + name
        present[canonical] = name
    missing = [n for n in expected if n not in present]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise UsageError(f"missing tensor {missing[0]}{more} in {fam.name} checkpoint {reader}")
    ignored = [re.compile(p) for p in fam.hf.ignored_patterns(cfg)]
    unexpected = [
        actual
        for canonical, actual in present.items()
        if canonical not in expected and not any(p.fullmatch(actual) for p in ignored)
    ]
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise UsageError(
            f"unexpected tensor {unexpected[0]}{more} in {fam.name} checkpoint {reader}"
        )
    for canonical, shape in expected.items():
        actual = present[canonical]
        found = reader.shape(actual)
        if found != shape:
            raise UsageError(f"{actual}: expected shape {shape}, found {found}")
        dtype = reader.dtype(actual)
        if dtype not in ("F64", "F32", "F16", "BF16"):
            raise UsageError(f"{actual}: expected a floating-point tensor, found {dtype}")
    return _Plan(rules=by_key, shapes=shapes, names=present, stacks=stacks)


def _layer_range(stacks: dict[str, tuple[int, int]], key: str) -> range:
    first, count = stacks[_stack_of(key)]
    return range(first, first + count)


def _check_expert_count(
    r: Rule, reader: CheckpointReader, num_experts: int, family: str, layer: int = 0
):
    """One line when the checkpoint's first expert layer holds another number of experts
    than the config."""
    pattern = re.compile(re.escape(r.hf.format(i=layer, e="@")).replace("@", r"(\d+)"))
    found = {int(m.group(1)) for n in reader.names() if (m := pattern.fullmatch(n))}
    if found and len(found) != num_experts:
        raise UsageError(
            f"{family} checkpoint {reader}: layer {layer} has {len(found)} experts "
            f"({r.hf.format(i=layer, e='*')}) but its config says num_experts={num_experts}"
        )


def _expert_shard_reader(plan: _Plan, reader: CheckpointReader, key, layer, shape):
    """index -> that slice of an expert param, reading only the layers and experts in it.

    Devices holding the same slice (replicated layouts) share one read."""
    r, j = plan.rules[key]
    one_expert = [plan.shapes[k][1:] for k in r.ours]
    hf_layers = plan.layers(key)
    stacked = layer is None
    e_dim = 1 if stacked else 0
    cache = {}

    def read(index):
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        memo = tuple((s.start, s.stop, s.step) for s in index)
        if memo not in cache:
            layers = range(*index[0].indices(shape[0])) if stacked else [layer]
            experts = range(*index[e_dim].indices(shape[e_dim]))
            block = np.stack(
                [
                    np.stack(
                        [
                            r.transform.load(
                                reader.read(plan.hf_name(r, hf_layers[i], e)).astype(
                                    np.float32, copy=False
                                ),
                                one_expert,
                            )[j]
                            for e in experts
                        ]
                    )
                    for i in layers
                ]
            )
            block = block if stacked else block[0]
            rest = (slice(None),) * (e_dim + 1) + index[e_dim + 1 :]
            cache[memo] = np.ascontiguousarray(block[rest], np.float32)
        return cache[memo]

    return read


def _host_param(plan: _Plan, reader: CheckpointReader, key, layer, shape) -> np.ndarray:
    """Our param as float32 on the host: stacked over layers when it is (`layer` None)."""
    r, j = plan.rules[key]
    # A fused tensor is split into all of its params' shapes; we keep the j-th.
    shapes = [plan.shapes[k] for k in r.ours]

    def one(i):
        w = reader.read(plan.hf_name(r, i)).astype(np.float32, copy=False)
        return r.transform.load(w, shapes)[j]

    if not r.per_layer:
        return np.ascontiguousarray(one(None), np.float32)
    hf_layers = plan.layers(key)
    if layer is not None:
        return np.ascontiguousarray(one(hf_layers[layer]), np.float32)
    out = np.empty(shape, np.float32)
    for ours, i in enumerate(hf_layers):
        out[ours] = one(i)
    return out


# --- from_pretrained / save_pretrained ---------------------------------------------------


def _concrete_mesh(mesh):
    mesh = jax.sharding.get_mesh() if mesh is None else mesh
    if not isinstance(mesh, jax.sharding.Mesh) or mesh.empty:
        raise ValueError(
            "from_pretrained needs a mesh of devices: pass mesh= or call it under "
            "`with jax.set_mesh(mesh):`"
        )
    return mesh


def from_pretrained(path: str, strategy, *, mesh=None, **overrides):
    """The model of the Hugging Face checkpoint directory `path`, laid out by `strategy`.

    `strategy`: a Strategy or its name, planned here on `mesh` (default: the active one,
    `jax.set_mesh`) with `overrides`, Config fields, e.g. runtime ones (dtype='bfloat16',
    remat='full', scan_layers=False, attention_impl='auto', max_seq_len=...); or the
    `ModelPlan` of this directory's config (`read_config(path, ...)`) that the caller planned
    once (nnx_zoo/launch/build.py), with no mesh or overrides. Parameters are float32.
    Raises UsageError (one line) for an unsupported architecture or a checkpoint whose
    tensors are missing, misshapen or unexpected, before any device memory is used.
    """
    if isinstance(strategy, ModelPlan):
        if mesh is not None or overrides:
            raise TypeError("from_pretrained takes a ModelPlan alone (no mesh, no overrides)")
        model_plan = strategy
        fam = family_for_config(model_plan.cfg)
        mesh = _concrete_mesh(model_plan.mesh)
    else:
        fam, cfg = family_and_config(path, overrides)
        mesh = _concrete_mesh(mesh)
        model_plan = plan_model(cfg, strategy, mesh)
    abstract = model_plan.abstract_model()
    cfg = model_plan.cfg  # the vocab padded for the split, where it needs that
    # A quantized checkpoint's tensors read dequantized, by their BF16 checkpoint's names.
    reader = dequantizing_reader(CheckpointReader(path), read_hf_config(path), fam)
    graphdef, state = nnx.split(abstract)
    flat = nnx.to_flat_state(state)
    for var_path, var in flat:
        if not isinstance(var, nnx.Param):
            name = "/".join(map(str, var_path))
            raise ValueError(f"{name}: a {type(var).__name__}, which no checkpoint holds")
    plan = _plan(fam, cfg, reader, _our_shapes(flat, cfg))

    for var_path, var in flat:
        key, layer = _param_key(var_path)
        shape = tuple(var.get_value().shape)
        spec = P(*(var.get_metadata().get("out_sharding") or ()))
        if plan.rules[key][0].per_expert:
            callback = _expert_shard_reader(plan, reader, key, layer, shape)
        else:
            host = _host_param(plan, reader, key, layer, _on_file(key, shape, cfg))
            # A padded vocab's extra rows start at zero (never looked up; logits masked).
            extra = [(0, ours - on_file) for ours, on_file in zip(shape, host.shape, strict=True)]
            host = np.pad(host, extra)
            callback = lambda index, host=host: host[index]  # noqa: E731
        array = jax.make_array_from_callback(shape, NamedSharding(mesh, spec), callback)
        var.set_value(array)
        del callback
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
    stacks = fmt.layer_stacks(cfg)
    copies = fmt.copied(cfg)
    try:
        for r in fmt.rules(cfg):
            layers = _layer_range(stacks, r.ours[0]) if r.per_layer else None
            if r.per_expert:
                experts = [params[k] for k in r.ours]
                _save_experts(r, experts, layers, writer_process and writer)
                continue
            ours = [_gather(params[k]) for k in r.ours]  # per layer: a list, else one array
            ours = [_drop_vocab_padding(k, o, cfg) for k, o in zip(r.ours, ours, strict=True)]
            if not writer_process:
                continue
            if r.per_layer:
                for ours_i, i in enumerate(layers):
                    writer.add(r.hf.format(i=i), r.transform.save(*[o[ours_i] for o in ours]))
            else:
                tensor = r.transform.save(*ours)
                writer.add(r.hf, tensor)
                for name in copies.get(r.hf, ()):  # its own buffer: a file holds no aliases
                    writer.add(name, np.array(tensor, copy=True))
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


def _save_experts(r: Rule, ours: list[dict], layers: range, writer) -> None:
    """One tensor per layer and expert, each assembled on the host from this process's
    shards (a stacked expert param may not fit one host; with experts split over processes
    each host holds only its own). `layers`: the hf layers of the stack, in its order."""
    blocks = [_LocalBlocks(o[None]) if None in o else None for o in ours]
    for i, hf_i in enumerate(layers):
        for e in range(next(iter(ours[0].values())).shape[-3]):
            expert = [
                b.get((i, e)) if b is not None else _LocalBlocks(o[i]).get((e,))
                for b, o in zip(blocks, ours, strict=True)
            ]
            if writer:
                writer.add(r.hf.format(i=hf_i, e=e), r.transform.save(*expert))


class _LocalBlocks:
    """`x[lead]` on the host, read from x's addressable shards, each copied over once.

    An array spread over processes is gathered whole instead (a collective every process
    joins), as `_to_host` does."""

    def __init__(self, x):
        self.x = x
        self.host = None if x.is_fully_addressable else _to_host(x)
        self._copies = {}

    def get(self, lead: tuple[int, ...]) -> np.ndarray:
        if self.host is not None:
            return self.host[lead]
        n = len(lead)
        out = np.empty(self.x.shape[n:], self.x.dtype)
        for shard in self.x.addressable_shards:
            index = shard.index
            starts = [index[d].indices(self.x.shape[d])[0] for d in range(n)]
            stops = [index[d].indices(self.x.shape[d])[1] for d in range(n)]
            if not all(a <= v < b for a, v, b in zip(starts, lead, stops, strict=True)):
                continue
            key = tuple(index[d].indices(self.x.shape[d]) for d in range(self.x.ndim))
            if key not in self._copies:
                self._copies[key] = np.asarray(shard.data)
            local = tuple(v - a for v, a in zip(lead, starts, strict=True))
            out[index[n:]] = self._copies[key][local]
        return out


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
