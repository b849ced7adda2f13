"""Helpers shared by the model tests: batches, one-device references, output recording."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from shardings import get_strategy
from shardings.specs import normalize
from zoo.layers import basic, decoder, mlp, moe
from zoo.layers.attention import layer as attention_mod


def packed_batch(batch=8, seq=32, vocab=512, seed=0, docs_per_row=3):
    """A packed batch: each row holds `docs_per_row` documents then some padding."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (batch, seq), dtype=np.int32)
    segment_ids = np.zeros((batch, seq), np.int32)
    positions = np.zeros((batch, seq), np.int32)
    for b in range(batch):
        cuts = np.sort(rng.choice(np.arange(2, seq - 2), docs_per_row, replace=False))
        start = 0
        for d, end in enumerate(cuts):
            segment_ids[b, start:end] = d + 1
            positions[b, start:end] = np.arange(end - start)
            start = end
        tokens[b, cuts[-1] :] = 0  # padding after the last document
    return {"tokens": tokens, "segment_ids": segment_ids, "positions": positions}


def one_device_mesh():
    return get_strategy("dp").make_mesh(devices=jax.devices()[:1])


def put_batch(batch, spec):
    return {k: jax.device_put(jnp.asarray(v), spec) for k, v in batch.items()}


def host_params(model):
    """Parameters as {path: np.ndarray}, gathered from whatever layout they have."""
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return {"/".join(map(str, p)): np.asarray(jax.device_get(v[...])) for p, v in flat}


def load_params(model, params):
    """Copy {path: array} into `model`, each array laid out like the live parameter."""
    state = nnx.state(model, nnx.Param)
    flat = nnx.to_flat_state(state)
    for path, var in flat:
        key = "/".join(map(str, path))
        var.set_value(jax.device_put(params[key], var[...].sharding))
    nnx.update(model, nnx.from_flat_state(flat))


def build_with_params(build, params, mesh):
    """`build()`'s model (built under `mesh`) holding `params` ({path: array}, e.g. the
    one-device model's) instead of its initial values, without compiling the initialiser (on
    8 simulated devices that compile costs about what a train step's does). The model is
    traced abstractly (`nnx.eval_shape`), which gives every variable the type the compiled
    initialiser would: under explicit axes an array's layout is part of its type, so each
    array put at its variable's traced layout is laid out as `build()` would lay it out, and
    a layout check on the result still checks the model's own choice. A model holding
    variables that `params` lacks (state other than parameters) is built and loaded."""
    with jax.set_mesh(mesh):
        graphdef, state = nnx.split(nnx.eval_shape(build))
    flat = nnx.to_flat_state(state)
    if not {"/".join(map(str, p)) for p, _ in flat} <= set(params):
        with jax.set_mesh(mesh):
            model = build()
        load_params(model, params)
        return model
    for path, var in flat:
        value, abstract = params["/".join(map(str, path))], var.get_value()
        assert value.shape == abstract.shape, (path, value.shape, abstract.shape)
        sharding = jax.NamedSharding(mesh, abstract.sharding.spec)
        var.set_value(jax.device_put(np.asarray(value, abstract.dtype), sharding))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def live_spec(x):
    return normalize(jax.typeof(x).sharding.spec, x.ndim)


def declared_out(module):
    """The output layout a module declares (for the composite modules, its last op's)."""
    if isinstance(module, attention_mod.Attention):
        return module.sharding.o.out
    if isinstance(module, mlp.Mlp):
        return module.sharding.down.out
    if isinstance(module, decoder.Block):
        return module.sharding.residual
    return module.sharding.out


@contextlib.contextmanager
def record_outputs():
    """Record (class name, declared out spec, live out spec) for every module call, including
    inside the layer scan, where outputs are traced but carry their sharding type."""
    records = []
    classes = [basic.Einsum, basic.Embed, basic.Norm, attention_mod.Attention, mlp.Mlp]
    classes += [moe.Moe, decoder.Block]
    originals = {cls: cls.__call__ for cls in classes}

    def wrap(cls, fn):
        def call(self, *args, **kwargs):
            out = fn(self, *args, **kwargs)
            value = out[0] if isinstance(out, tuple) else out
            # A call that names its result's layout declares it (the final norm inside the
            # 1F1B pipeline's loop, where the rows are not split over `stage`).
            declared = kwargs.get("out_sharding") or declared_out(self)
            records.append((cls.__name__, normalize(declared, value.ndim), live_spec(value)))
            return out

        return call

    for cls, fn in originals.items():
        cls.__call__ = wrap(cls, fn)
    try:
        yield records
    finally:
        for cls, fn in originals.items():
            cls.__call__ = fn


def count_constructions(monkeypatch) -> dict[str, int]:
    """{'n': how many model objects are constructed from now on}: abstractly (a plan's shapes)
    or traced by an initialising jit; a DecoderLM's __init__ runs once for each."""
    count = {"n": 0}
    init = decoder.DecoderLM.__init__

    def counted(self, *args, **kwargs):
        count["n"] += 1
        init(self, *args, **kwargs)

    monkeypatch.setattr(decoder.DecoderLM, "__init__", counted)
    return count


def save_as_run(workdir: str, run, mesh, model, optimizer, step: int = 3) -> None:
    """`model` and `optimizer` (fsdp_tp on `mesh`) saved at `step` as a run of `run`'s config
    saves them: with its data iterator and run_info, for eval_main / serve_main to load."""
    from nnx_zoo import data
    from nnx_zoo.checkpoint.manager import Checkpointer
    from nnx_zoo.data.tokenizers import make_tokenizer

    tokenizer = make_tokenizer(run.data.tokenizer)
    it = data.make_dataset(
        run.data.source, "train", tokenizer, run.data.seq_len, run.data.global_batch_size
    )
    run_info = {"config": run.to_dict(), "strategy": "fsdp_tp", "mesh_shape": dict(mesh.shape)}
    ckpt = Checkpointer(workdir, save_every=1, keep=1, run_info=run_info)
    ckpt.save(step, model=model, optimizer=optimizer, data_iter=it)
    ckpt.close()
