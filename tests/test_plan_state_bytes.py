"""The planner's per-device bytes of parameters, Adam state and gradients equal those of the
arrays `create_model` and `nnx.Optimizer` really make under each strategy (tiny, on the 8
simulated devices), and, for llama3.1-8b, those its declared layouts imply."""

import math

import jax
import numpy as np
import pytest
from flax import nnx

from nnx_zoo.planning.chips import CHIPS
from nnx_zoo.planning.compile import Candidate, Target, layout_state_bytes
from nnx_zoo.training import optim
from nnx_zoo.training.config import RunConfig
from shardings import STRATEGIES, get_strategy
from zoo import create_model, param_layouts

NAMES = ["dp", "fsdp", "tp", "fsdp_tp"]


def _run(preset: str) -> RunConfig:
    return RunConfig.from_config_dict(
        # A batch that splits over 64 devices: the planner builds the run as train_main does,
        # batch checks included.
        {"model": {"preset": preset, "dtype": "bfloat16"}, "data": {"global_batch_size": 64}}
    )


def _device0_bytes(tree) -> int:
    """Bytes that device 0 holds of every array in `tree`."""
    total = 0
    for x in jax.tree.leaves(tree):
        shard = next(s for s in x.addressable_shards if s.device == jax.devices()[0])
        total += shard.data.nbytes
    return total


@pytest.mark.parametrize("name", NAMES)
def test_tiny_state_bytes_equal_the_real_arrays(name):
    run = _run("tiny")
    strategy = get_strategy(name)
    shape = strategy.default_mesh_shape(8, run.model.decoder_config())
    target = Target("cpu:8", tuple(jax.devices()), CHIPS["cpu"])
    planned = layout_state_bytes(run, Candidate(name, shape, "none", 1), target)

    mesh = strategy.make_mesh(shape=shape)
    with jax.set_mesh(mesh):
        model = create_model(run.model.decoder_config(), strategy, rngs=nnx.Rngs(0))
        tx, _ = optim.make_optimizer(learning_rate=1e-3, warmup_steps=0, total_steps=10)
        optimizer = nnx.jit(lambda m: nnx.Optimizer(m, tx, wrt=nnx.Param))(model)
        params = nnx.state(model, nnx.Param)
        # The gradients' types (shape, dtype, sharding) without computing them.
        grads = nnx.eval_shape(nnx.grad(lambda m: _sum(nnx.state(m, nnx.Param))), model)
    assert planned.params == _device0_bytes(params)
    assert planned.optimizer == _device0_bytes(nnx.state(optimizer.opt_state))
    assert planned.gradients == sum(
        math.prod(g.sharding.shard_shape(g.shape)) * g.dtype.itemsize
        for g in jax.tree.leaves(grads)
    )


def _sum(tree):
    return sum(x.astype(np.float32).sum() for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("name", NAMES)
def test_llama_8b_bytes_equal_its_declared_layouts(name):
    run = _run("llama3.1-8b")
    cfg = run.model.decoder_config()
    strategy = STRATEGIES[name]
    shape = strategy.default_mesh_shape(64, cfg)
    sizes = dict(zip(strategy.axes, shape, strict=True))
    # 64 devices: the abstract mesh never touches them, only their count matters.
    devices = tuple(jax.devices()) * 8
    target = Target("cpu:64", devices, CHIPS["cpu"])
    planned = layout_state_bytes(run, Candidate(name, shape, "full", 1), target)

    # Independently: every parameter's declared spec, each sharded dim divided by its axes.
    expected = 0
    for _, dims, spec in param_layouts(cfg, strategy):
        entries = tuple(spec) + (None,) * (len(dims) - len(spec))
        local = 1
        for size, axes in zip(dims, entries, strict=True):
            axes = () if axes is None else (axes if isinstance(axes, tuple) else (axes,))
            local *= size // math.prod(sizes[a] for a in axes)
        expected += local * 4  # float32 parameters
    assert planned.params == expected
    assert planned.gradients == expected
    # Adam: two moments with the parameters' layouts, plus step counters (int32 scalars).
    assert 2 * expected <= planned.optimizer <= 2 * expected + 64


def test_lora_gradients_are_the_adapters_only():
    """With LoRA the optimizer trains the adapters alone: gradients (and Adam's moments) are
    theirs, while the frozen base still counts as parameters."""
    from zoo.layers.lora import LoraParam

    run = RunConfig.from_config_dict(
        {
            "model": {"preset": "tiny"},
            "data": {"global_batch_size": 64},
            "lora": {"rank": 4, "targets": "q_proj,v_proj"},
        }
    )
    strategy = get_strategy("fsdp")
    shape = strategy.default_mesh_shape(8, run.model.decoder_config())
    target = Target("cpu:8", tuple(jax.devices()), CHIPS["cpu"])
    candidate = Candidate("fsdp", shape, "none", 1)
    planned = layout_state_bytes(run, candidate, target)

    from nnx_zoo.launch.build import build
    from nnx_zoo.planning.compile import make_mesh, run_for

    built = build(run_for(run, candidate), make_mesh(target, candidate), abstract=True)
    adapters = nnx.state(built.model, LoraParam)
    base = nnx.state(built.model, nnx.Param)

    def shard_bytes(tree):
        return sum(
            math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
            for x in jax.tree.leaves(tree)
        )

    assert 0 < planned.gradients == shard_bytes(adapters) < shard_bytes(base)
    assert planned.params == shard_bytes(base) + shard_bytes(adapters)
