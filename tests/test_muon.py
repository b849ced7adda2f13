"""Muon (nnx_zoo/training/muon.py): on one device it is `optax.contrib.muon` with the same
partition of parameters; under fsdp, fsdp_tp and fsdp_ep ten training steps equal one device's.

Tolerances: float32. The sharded gradients are summed in another order than one device's
(see test_strategies_equal_one_device.py), and Newton-Schulz's first steps multiply a
perturbation of the momentum's small singular values by up to ~3.4 each, hence 1e-4 relative
on the ten-step losses and Muon's matrices, as the issue asks (measured: losses 2.5e-7,
matrices 2.7e-6). The AdamW half's parameters get 1e-3: Adam moves an element whose gradient is
rounding-sized by about the learning rate whatever its sign, so a sign that rounding flips
moves it by up to 2 x lr a step (the lm_head under fsdp_ep: 1.1e-4 to 1.7e-4 measured; the dense and
MoE equality tests compare only AdamW's losses for this reason).
Against optax on one device the arithmetic is the same up to einsum vs matmul and the order
of a few scalar products: 2e-5 (3e-6 measured).
"""

from __future__ import annotations

import math
import re

import jax
import numpy as np
import optax
import pytest
from _train_helpers import run_config
from flax import nnx
from model_utils import build_with_params, host_params, one_device_mesh, packed_batch, put_batch

from nnx_zoo.errors import UsageError
from nnx_zoo.launch.build import build
from nnx_zoo.training import muon
from nnx_zoo.training.optim import make_optimizer
from shardings import get_strategy
from zoo import create_model, get_config
from zoo.layers.basic import Einsum
from zoo.loss import lm_loss

STEPS = 10
LR, WD = 1e-2, 0.1
MODELS = {"dense": get_config("tiny"), "moe": get_config("qwen3-moe-tiny")}
# fsdp on 8: L=2 divides no axis, each matrix gathered whole; fsdp_tp on 4x2: L split over
# `model`, `data` gathered; fsdp_ep on 2x4: experts keep `expert`, L takes `data`.
CASES = [("fsdp", (8,), "dense"), ("fsdp_tp", (4, 2), "dense"), ("fsdp_ep", (2, 4), "moe")]
# What Muon trains in qwen3-moe-tiny (every other parameter is AdamW's).
MUON_PARAMS = {
    "blocks/attention/q/weight",
    "blocks/attention/k/weight",
    "blocks/attention/v/weight",
    "blocks/attention/o/weight",
    "blocks/moe/gate",
    "blocks/moe/up",
    "blocks/moe/down",
}


def _muon_tx():
    tx, _ = make_optimizer(
        learning_rate=LR,
        warmup_steps=0,
        total_steps=STEPS,
        weight_decay=WD,
        clip_grad_norm=0,
        # optax.contrib.muon decays every AdamW parameter; the mask is test_optim's subject.
        decay_norms_and_embeddings=True,
        muon=muon.MuonOptions(),
    )
    return tx


def _optax_tx():
    _, schedule = make_optimizer(learning_rate=LR, warmup_steps=0, total_steps=STEPS)
    return optax.contrib.muon(
        schedule,
        beta=0.95,
        ns_steps=5,
        eps=1e-8,
        weight_decay=WD,
        adam_b1=0.9,
        adam_b2=0.95,
        adam_weight_decay=WD,
        consistent_rms=0.2,
        muon_weight_dimension_numbers=muon.dimension_numbers_tree,
    )


def _train(cfg, strategy, mesh, tx, init_params=None):
    """(the ten losses, the parameters after them): one compiled step, called ten times."""
    strategy = get_strategy(strategy)
    batch_np = packed_batch(batch=8, seq=32, vocab=cfg.vocab_size)
    with jax.set_mesh(mesh):
        if init_params is None:
            model = create_model(cfg, strategy, rngs=nnx.Rngs(0))
        else:  # the given values at create_model's layouts, with no init compile
            build = lambda: create_model(cfg, strategy, rngs=nnx.Rngs(0))  # noqa: E731
            model = build_with_params(build, init_params, mesh)
        batch = put_batch(batch_np, strategy.batch_spec())
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

        @nnx.jit
        def step(model, optimizer, batch):
            def loss_fn(model):
                logits = model(
                    batch["tokens"], segment_ids=batch["segment_ids"], positions=batch["positions"]
                )
                return lm_loss(logits, batch["tokens"], batch["segment_ids"])[0]

            loss, grads = nnx.value_and_grad(loss_fn)(model)
            optimizer.update(model, grads)
            return loss

        initial = host_params(model)
        losses = [float(step(model, optimizer, batch)) for _ in range(STEPS)]
        return losses, initial, host_params(model)


@pytest.fixture(scope="module")
def one_device():
    """Muon on one device, for each model the cases use: (losses, initial, final params)."""
    mesh = one_device_mesh()
    return {key: _train(cfg, "dp", mesh, _muon_tx()) for key, cfg in MODELS.items()}


def _assert_close(got, want, rtol, adam_rtol=None):
    """Losses and Muon's matrices within `rtol`; the AdamW half's parameters within
    `adam_rtol` (default `rtol`)."""
    got_losses, _, got_params = got
    want_losses, _, want_params = want
    np.testing.assert_allclose(got_losses, want_losses, rtol=rtol)
    assert set(got_params) == set(want_params)
    for name, value in want_params.items():
        tol = rtol if muon.dimension_numbers(name.split("/")) else (adam_rtol or rtol)
        scale = np.abs(value).max()
        err = np.abs(got_params[name] - value).max() / scale
        assert err < tol, f"{name}: max |diff| / max |value| = {err:.2e}"


def test_partition_is_the_hidden_matrices():
    with jax.set_mesh(one_device_mesh()):
        model = create_model(MODELS["moe"], get_strategy("dp"), rngs=nnx.Rngs(0))
    # As optax sees the parameters at init: nnx.Param variables, paths ending in 'value'.
    matrices, rest = muon._split(nnx.state(model, nnx.Param))
    labels = {}
    for label, half in (("muon", matrices), ("adam", rest)):
        for path, _ in jax.tree_util.tree_flatten_with_path(half)[0]:
            labels["/".join(k.key for k in path)] = label
    assert {name for name, label in labels.items() if label == "muon"} == MUON_PARAMS
    # The router, norms, embedding and head are AdamW's.
    assert labels["blocks/moe/router/weight"] == labels["lm_head/weight"] == "adam"


def test_matrix_dims_follow_the_einsums():
    """Each hidden matrix's rows are the dims its einsum contracts, its columns the dims it
    outputs, and the dims before them (L) a batch."""
    with jax.set_mesh(one_device_mesh()):
        model = create_model(MODELS["dense"], get_strategy("dp"), rngs=nnx.Rngs(0))
    checked = 0
    for path, module in nnx.iter_graph(model):
        if not isinstance(module, Einsum):
            continue
        names = [str(p) for p in path]
        dims = muon.dimension_numbers([*names, "weight"])
        if "blocks" not in names:
            assert dims is None, names
            continue
        inputs, out = module.eq.split("->")
        x, w = inputs.split(",")
        rows = [w.index(c) - len(w) for c in w if c in x and c not in out]
        cols = [w.index(c) - len(w) for c in w if c in out]
        as_tuple = lambda a: (a,) if isinstance(a, int) else tuple(a)  # noqa: E731
        assert as_tuple(dims.reduction_axis) == tuple(rows), names
        assert as_tuple(dims.output_axis) == tuple(cols), names
        checked += 1
    assert checked == 7  # q, k, v, o, gate, up, down


# What Muon trains in deepseek-v3-tiny: in both stacks (`dense_blocks`, its dense first layer,
# and `blocks`) the MLA projections, the dense layer's mlp, the MoE layers' experts and their
# shared experts. The latent norms, the router and its score-correction bias are AdamW's.
_MLA = ("q_a", "q_b", "kv_a", "kv_b", "o")
DSV3_MUON_PARAMS = {
    *(f"{stack}/attention/{w}/weight" for stack in ("dense_blocks", "blocks") for w in _MLA),
    *(f"dense_blocks/mlp/{w}/weight" for w in ("gate", "up", "down")),
    *(f"blocks/moe/{w}" for w in ("gate", "up", "down")),
    *(f"blocks/moe/shared/{w}/weight" for w in ("gate", "up", "down")),
}


def test_every_layer_stack_is_muons_deepseek_v3():
    """deepseek-v3-tiny: the partition is DSV3_MUON_PARAMS; each of its einsums' matrix dims
    follow the equation; and one update of the real optimizer moves Muon's matrices by
    Muon's RMS (0.2 x lr, orthogonalized) and everything else by Adam's (~1.5 x lr on a
    first Nesterov step), so the paths reach the transformation they name."""
    with jax.set_mesh(one_device_mesh()):
        model = create_model(get_config("deepseek-v3-tiny"), get_strategy("dp"), rngs=nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    matrices, _ = muon._split(params)
    got = {"/".join(muon._names(p)) for p, _ in jax.tree_util.tree_flatten_with_path(matrices)[0]}
    assert got == DSV3_MUON_PARAMS

    checked = 0
    for path, module in nnx.iter_graph(model):
        names = [str(p) for p in path]
        if not isinstance(module, Einsum) or not muon.dimension_numbers([*names, "weight"]):
            continue
        dims = muon.dimension_numbers([*names, "weight"])
        inputs, out = module.eq.split("->")
        x, w = inputs.split(",")
        as_tuple = lambda a: (a,) if isinstance(a, int) else tuple(a)  # noqa: E731
        assert as_tuple(dims.reduction_axis) == tuple(
            w.index(c) - len(w) for c in w if c in x and c not in out
        ), names
        assert as_tuple(dims.output_axis) == tuple(w.index(c) - len(w) for c in w if c in out)
        checked += 1
    assert checked == len(DSV3_MUON_PARAMS) - 3  # every one but the expert stacks

    tx, _ = make_optimizer(
        learning_rate=LR,
        warmup_steps=0,
        total_steps=STEPS,
        weight_decay=0.0,
        clip_grad_norm=0,
        muon=muon.MuonOptions(),
    )
    grads = jax.tree.map(
        lambda x: jax.random.normal(jax.random.key(x.size), x.shape, x.dtype), params
    )
    with jax.set_mesh(one_device_mesh()):
        updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    for path, u in jax.tree_util.tree_flatten_with_path(updates)[0]:
        name = "/".join(muon._names(path))
        rms = float(np.sqrt(np.mean(np.square(np.asarray(u))))) / LR
        # Newton-Schulz leaves singular values in ~[0.7, 1.2]: RMS 0.2 x that.
        want = (0.1, 0.3) if name in DSV3_MUON_PARAMS else (1.0, 2.0)
        assert want[0] < rms < want[1], f"{name}: update RMS {rms:.3f} x lr"


def test_one_device_equals_optax_contrib_muon(one_device):
    """Ten steps of our Muon and of optax.contrib.muon given the same partition and the same
    dimension numbers, from the same parameters, on one device, for both models."""
    mesh = one_device_mesh()
    for key, cfg in MODELS.items():
        ours = one_device[key]
        reference = _train(cfg, "dp", mesh, _optax_tx(), init_params=ours[1])
        _assert_close(ours, reference, rtol=2e-5)
        # Muon moved the matrices (the comparison is not of two unchanged models).
        assert not np.allclose(
            ours[2]["blocks/attention/q/weight"], ours[1]["blocks/attention/q/weight"]
        )


@pytest.mark.parametrize("name,shape,model", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_sharded_equals_one_device(one_device, name, shape, model):
    reference = one_device[model]
    mesh = get_strategy(name).make_mesh(shape=shape)
    got = _train(MODELS[model], name, mesh, _muon_tx(), init_params=reference[1])
    _assert_close(got, reference, rtol=1e-4, adam_rtol=1e-3)


@pytest.mark.parametrize(
    "mesh,shape,batch,spec,want",
    [
        # L=32 over 8 devices: the M split moves to L (one all-to-all each way); the
        # parameter is replicated over `replica`, and stays so (no update crosses slices).
        ({"replica": 2, "data": 8}, (32, 4096, 14336), (0,), (None, "data"), ("data",)),
        # L=2 divides no 8-way axis: the matrices are gathered whole.
        ({"data": 8}, (2, 64, 128), (0,), (None, "data"), ()),
        # Experts keep `expert`; `data` goes to the first batch dim it divides (L).
        (
            {"data": 2, "expert": 4},
            (2, 8, 64, 64),
            (0, 1),
            (None, "expert", "data"),
            ("data", "expert"),
        ),
        # fsdp_tp's q [L, M/data, N/model, D]: L=32 takes both axes.
        (
            {"data": 4, "model": 2},
            (32, 64, 8, 16),
            (0,),
            (None, "data", "model"),
            (("data", "model"),),
        ),
    ],
)
def test_ns_layout(mesh, shape, batch, spec, want):
    mesh = jax.sharding.AbstractMesh(tuple(mesh.values()), tuple(mesh))
    got = muon.ns_layout(shape, jax.sharding.PartitionSpec(*spec), batch, mesh)
    # The batch dims carry the axes; the matrix dims are whole.
    assert tuple(got) == (*want, *[None] * (len(shape) - len(want)))


def test_abstract_build_and_state_bytes():
    """The planner's path: the run config's optimizer.name=muon built abstractly
    (`nnx.eval_shape`, train_main's fsdp_tp mesh); its optimizer state is one moment per
    hidden-matrix element where AdamW keeps two."""
    sizes = {}
    for name in ("adamw", "muon"):
        built = build(run_config({"optimizer.name": name}), abstract=True)
        leaves = jax.tree.leaves(nnx.state(built.optimizer.opt_state))
        sizes[name] = sum(math.prod(x.shape) for x in leaves if x.ndim)
        matrices, _ = muon._split(nnx.state(built.model, nnx.Param))
    matrix_elements = sum(math.prod(x.shape) for x in jax.tree.leaves(matrices))
    # Muon's state adds its three Newton-Schulz coefficients.
    assert sizes["muon"] == sizes["adamw"] - matrix_elements + len(muon.NS_COEFFS)


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"optimizer.name": "sgd"}, "config optimizer.name='sgd': valid: adamw, muon"),
        ({"optimizer.name": "muon", "lora.rank": 4}, "use optimizer.name=adamw with LoRA"),
        ({"optimizer.muon_ns_steps": 0}, "config optimizer.muon_ns_steps=0: must be > 0"),
    ],
)
def test_config_mistakes_are_one_line(overrides, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        run_config(overrides)
