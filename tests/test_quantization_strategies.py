"""The quantized tiny model under the strategies equals the quantized one-device model: loss
and gradients of one packed batch.

Tolerance reasoning (float32 compute): the scales are global (each tensor's amax is a max,
all-reduced exactly), so the sharded run quantizes the same values as one device except
where float32 summation order already differs (~1e-6 relative). Such a value on a rounding
boundary rounds to the neighbouring grid point, one step of its format (2^-3 of it in e4m3,
2^-2 in e5m2, 1/127 of its row's amax in int8), and the flip moves every value computed from
it, so later quantizations flip more: a cascade through the backward pass, strongest where
gradients are sums that cancel. So the check is against the quantization's own error: the
loss to 1e-5, and each gradient's distance from the one-device quantized one below the
distance between one device's quantized and float gradients. Measured, worst tensor per
case (jax 0.10.2 and 0.12.0.1 alike): fp8 fsdp_tp 0.80 of it (the embedding table; k 0.63),
fp8 fsdp_pp 0.03, int8 0.02 at most, 0.000 where nothing flipped. A noise re-rolled by the
cascade entirely would sit near sqrt(2); a layout bug (a wrong scale, a transposed or
unreduced gradient) is off by the gradient's own norm, ~10x its quantization error here.

Pipelines quantize per micro-batch: a stage's dot sees one micro-batch, so an fp8 scale is
that micro-batch's amax (and int8's weight-gradient scales, per column over the rows, too).
Their reference is the one-device model run on the same micro-batches (rows m, m + Mb, ...),
each alone. Against the whole-batch reference the fsdp_pp fp8 loss is off by 2.4e-4 and a
gradient by 1.12x the quantization error (measured): the recipe, as with gradient
accumulation, not a layout bug.

Every strategy, the two formats taking turns (a case is one compile of the model, ~10 s); a
test checks that the cases split every mesh axis some strategy has. Micro-batch m is the
m-th run of b = B / (D x Mb) rows of every data shard: rows m, m + Mb, ... only where b is 1
(fsdp_pp on 2 x 4); fsdp_tp_pp's data:2 gives runs of 2, and a reference cut the other way
quantizes other rows together (loss off by 2.9e-5, a gradient by 1.36x the quantization
error: measured).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from model_utils import host_params, one_device_mesh, packed_batch, put_batch

from shardings import STRATEGIES, get_strategy
from zoo import create_model, get_config, pipelined
from zoo.build import model_class
from zoo.layers import pipeline
from zoo.loss import lm_loss

CASES = [
    ("int8", "dp", (8,)),  # batch split
    ("fp8", "fsdp", (8,)),  # FSDP gathers
    ("int8", "tp", (4, 2)),  # heads and F over `model`
    ("fp8", "fsdp_tp", (4, 2)),  # both contractions split
    ("int8", "hsdp", (2, 4)),  # batch over `replica` x `data`
    ("fp8", "fsdp_cp", (4, 2)),  # T over `context`
    ("int8", "fsdp_tp_ep", (2, 2, 2)),  # a dense model: the batch over `data` x `expert`
    ("fp8", "fsdp_pp", (2, 4)),  # 2 stages of the 2 layers, 2 micro-batches (one per stage)
    # The strategies that compose those splits (each ~10 s here).
    ("fp8", "hsdp_tp", (2, 2, 2)),
    ("int8", "fsdp_tp_cp", (2, 2, 2)),
    ("fp8", "fsdp_ep", (4, 2)),
    ("fp8", "fsdp_tp_pp", (2, 2, 2)),  # 2 rows a data shard per micro-batch: see _microbatch
]
BATCH = packed_batch(batch=8, seq=32, vocab=get_config("tiny").vocab_size)


def test_every_mesh_axis_is_split_by_a_case():
    every_axis = {axis for strategy in STRATEGIES.values() for axis in strategy.axes}
    assert {axis for _, name, _ in CASES for axis in get_strategy(name).axes} == every_axis


def microbatch_rows(batch_size: int, microbatches: int, data_shards: int) -> list[np.ndarray]:
    """The rows of each micro-batch as the pipeline cuts them (zoo/layers/pipeline.py
    `_microbatch`): every data shard's rows are Mb runs of b = B / (D * Mb) rows, micro-batch
    m taking the m-th run of each shard."""
    b = batch_size // (data_shards * microbatches)
    rows = np.arange(batch_size).reshape(data_shards, microbatches, b)
    return [rows[:, m].reshape(-1) for m in range(microbatches)]


def _logits(model, batch, groups: tuple[tuple[int, ...], ...] | None):
    """The model's logits; with micro-batches (`groups` of rows: the pipeline's cut), each run
    alone, so that each quantizes with its own scales as a pipeline stage does."""

    def take(a, rows):  # explicit sharding asks a gather for its output's layout
        return a.at[rows].get(out_sharding=jax.typeof(a).sharding.spec)

    def run(rows):
        tokens, segments = take(batch["tokens"], rows), take(batch["segment_ids"], rows)
        return model(tokens, segment_ids=segments, positions=take(batch["positions"], rows))

    pp = pipeline.plan_for(model.cfg, model.sharding, jax.sharding.get_abstract_mesh())
    if pp is not None:  # the schedule cuts its own micro-batches (zoo/pipelined.py)
        tokens, segments, positions = batch["tokens"], batch["segment_ids"], batch["positions"]
        return pipelined.logits(model, pp, tokens, segment_ids=segments, positions=positions)
    if groups is None:
        tokens, segments, positions = batch["tokens"], batch["segment_ids"], batch["positions"]
        return model(tokens, segment_ids=segments, positions=positions)
    order = np.concatenate(groups)
    stacked = jnp.concatenate([run(np.asarray(rows)) for rows in groups], axis=0)
    return take(stacked, np.argsort(order))  # back to the batch's row order


def _model(cfg, strategy, mesh, params):
    """The model holding `params` ({path: array}), each laid out as `strategy` declares it,
    built from shapes (no init to compile: that costs about what the step does)."""
    cls = model_class(cfg)
    with jax.set_mesh(mesh):
        abstract = nnx.eval_shape(lambda: cls(cfg, strategy.lm_sharding(), rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    flat = nnx.to_flat_state(state)
    for path, var in flat:
        spec = P(*(var.get_metadata().get("out_sharding") or ()))
        value = params["/".join(map(str, path))]
        var.set_value(jax.device_put(value, NamedSharding(mesh, spec)))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _loss_and_grads(cfg, strategy_name, mesh, params, groups=None):
    """(loss, {path: gradient}) of one packed batch at `params`, under the strategy."""
    strategy = get_strategy(strategy_name)
    model = _model(cfg, strategy, mesh, params)
    with jax.set_mesh(mesh):
        batch = put_batch(BATCH, strategy.batch_spec())

        @nnx.jit
        def loss_and_grads(model, batch):
            def loss_fn(model):
                logits = _logits(model, batch, groups)
                return lm_loss(logits, batch["tokens"], batch["segment_ids"])[0]

            return nnx.value_and_grad(loss_fn)(model)

        loss, grads = loss_and_grads(model, batch)
    flat = nnx.to_flat_state(nnx.state(grads, nnx.Param))
    return float(loss), {"/".join(map(str, p)): np.asarray(v[...]) for p, v in flat}


@functools.cache
def _initial_params():
    """The tiny model's parameters from seed 0, on the host: every run starts from them."""
    with jax.set_mesh(one_device_mesh()):
        return host_params(create_model(get_config("tiny"), get_strategy("dp"), rngs=nnx.Rngs(0)))


@functools.cache
def _reference(quantization, groups=None):
    """The one-device run with `quantization` ('none' too): (loss, grads); with `groups`,
    each micro-batch of rows quantized alone."""
    cfg = get_config("tiny", quantization=quantization)
    return _loss_and_grads(cfg, "dp", one_device_mesh(), _initial_params(), groups)


@pytest.mark.parametrize(
    "case", CASES, ids=[f"{q}-{s}-{'x'.join(map(str, m))}" for q, s, m in CASES]
)
def test_quantized_strategy_equals_one_device(case):
    quantization, name, shape = case
    strategy = get_strategy(name)
    mesh = strategy.make_mesh(shape=shape)
    groups = None
    if "stage" in mesh.shape:
        # One micro-batch per stage (pipeline_microbatches=0), cut as the pipeline cuts.
        data_shards = mesh.size // mesh.shape["stage"] // mesh.shape.get("model", 1)
        cut = microbatch_rows(BATCH["tokens"].shape[0], mesh.shape["stage"], data_shards)
        groups = tuple(tuple(int(r) for r in rows) for rows in cut)
    ref_loss, ref_grads = _reference(quantization, groups)
    float_grads = _reference("none")[1]
    cfg = get_config("tiny", quantization=quantization)
    loss, grads = _loss_and_grads(cfg, name, mesh, _initial_params())
    assert abs(loss - ref_loss) < 1e-5, (loss, ref_loss)
    assert set(grads) == set(ref_grads)
    for path, g in ref_grads.items():
        layout_error = np.linalg.norm(grads[path] - g)
        quantization_error = np.linalg.norm(g - float_grads[path])
        assert layout_error < quantization_error, (path, layout_error, quantization_error)
