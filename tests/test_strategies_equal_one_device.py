"""Every strategy, on every mesh shape it accepts: declared layouts are the live ones, and
logits, loss, gradients and ten AdamW steps equal the one-device run.

Tolerances: float32 throughout. A split contraction sums its partial products in another
order than one device does (all-reduce / reduce-scatter of per-shard sums), so results
agree to float32 rounding of O(1) values accumulated over a few hundred terms, not bit for
bit: 2e-5 absolute on logits and losses, 1e-5 + 1e-4 relative on gradients (which are
small and relative error dominates). Ten Adam steps amplify rounding through the 1/sqrt(v)
normalization of tiny gradients, hence 1e-4 relative on the loss sequence.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from model_utils import (
    build_with_params,
    host_params,
    live_spec,
    one_device_mesh,
    packed_batch,
    put_batch,
    record_outputs,
)

from shardings import get_strategy
from shardings.specs import normalize
from zoo import create_model, get_config, param_layouts
from zoo.loss import lm_loss

CFG = get_config("tiny")
CASES = [
    ("dp", (8,)),
    ("fsdp", (8,)),
    ("tp", (4, 2)),
    ("tp", (2, 4)),
    ("fsdp_tp", (4, 2)),
    ("fsdp_tp", (2, 4)),
    # Sequence parallelism: the residual split on T over `model` (2 and 4), so packed rows'
    # documents cross the T shards between blocks.
    ("fsdp_tp_sp", (4, 2)),
    ("tp_sp", (2, 4)),
    ("hsdp", (2, 4)),
    ("hsdp_tp", (2, 2, 2)),
    # T split over `context` 2 and 4: the packed rows' documents cross chunk borders.
    ("fsdp_cp", (4, 2)),
    ("fsdp_cp", (2, 4)),
    ("fsdp_tp_cp", (2, 2, 2)),
    # Ring attention (model.context_parallel=ring): K/V blocks passed around `context`.
    ("fsdp_cp", (2, 4), {"context_parallel": "ring"}),
    ("fsdp_tp_cp", (2, 2, 2), {"context_parallel": "ring"}),
    # A dense model under the MoE strategy: fsdp_tp with the batch over `data` x `expert`.
    ("fsdp_tp_ep", (2, 2, 2)),
]


def _loss_and_grads(model, batch):
    """(loss, logits, grads, extras): the LM loss; `extras` are further scalars to compare
    (none here; the MoE test's objective adds its aux loss)."""

    def loss_fn(model):
        logits = model(
            batch["tokens"], segment_ids=batch["segment_ids"], positions=batch["positions"]
        )
        return lm_loss(logits, batch["tokens"], batch["segment_ids"])[0], logits

    (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    return loss, logits, grads, {}


def _run(strategy, mesh, init_params=None, cfg=CFG, objective=_loss_and_grads):
    """Everything the checks compare, from one model under `strategy` (a name, or a Strategy
    of the test's own): layouts, logits, loss, grads, the loss sequence of ten AdamW steps,
    and the objective's extra scalars."""
    strategy = get_strategy(strategy) if isinstance(strategy, str) else strategy
    batch_np = packed_batch(batch=8, seq=32, vocab=cfg.vocab_size)
    with jax.set_mesh(mesh):
        if init_params is None:
            model = create_model(cfg, strategy, rngs=nnx.Rngs(0))
        else:  # the reference's values at the layouts create_model gives, with no init compile
            build = lambda: create_model(cfg, strategy, rngs=nnx.Rngs(0))  # noqa: E731
            model = build_with_params(build, init_params, mesh)
        batch = put_batch(batch_np, strategy.batch_spec())
        optimizer = nnx.Optimizer(model, optax.adamw(3e-3, weight_decay=0.1), wrt=nnx.Param)

        # One compiled step serves every check: its first call sees the initial parameters.
        @nnx.jit
        def step(model, optimizer, batch):
            loss, logits, grads, extras = objective(model, batch)
            optimizer.update(model, grads)
            return loss, logits, grads, extras

        params = host_params(model)
        live_layouts = {
            "/".join(map(str, p)): live_spec(v[...])
            for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
        }
        with record_outputs() as records:
            loss, logits, grads, extras = step(model, optimizer, batch)
        out = {
            "params": params,
            "live_layouts": live_layouts,
            "records": records,
            "loss": float(loss),
            **{name: float(value) for name, value in extras.items()},
            "logits": np.asarray(logits),
            "grads": {
                "/".join(map(str, p)): np.asarray(v[...])
                for p, v in nnx.to_flat_state(nnx.state(grads, nnx.Param))
            },
        }
        losses = [out["loss"]] + [float(step(model, optimizer, batch)[0]) for _ in range(9)]
        out["adam_losses"] = losses
    return out


def _case_id(name, shape, overrides=None):
    extra = "".join(f"-{v}" for v in (overrides or {}).values())
    return f"{name}-{'x'.join(map(str, shape))}{extra}"


def equality_fixtures(run, cases):
    """An equality test's module fixtures: `reference`, `run("dp", one device)`, and
    `sharded`, `(name, run(name, its mesh))` for each (strategy, mesh shape[, model config
    overrides]) case, from the reference's parameters. A module binds both names:
    `reference, sharded = ...`."""

    @pytest.fixture(scope="module")
    def reference():
        return run("dp", one_device_mesh())

    @pytest.fixture(scope="module", params=cases, ids=[_case_id(*case) for case in cases])
    def sharded(request, reference):
        name, shape, *overrides = request.param
        mesh = get_strategy(name).make_mesh(shape=shape)
        extra = {"cfg": CFG.replace(**overrides[0])} if overrides else {}
        return name, run(name, mesh, init_params=reference["params"], **extra)

    return reference, sharded


reference, sharded = equality_fixtures(_run, CASES)


def test_parameter_layouts_are_declared(sharded):
    check_parameter_layouts(CFG, sharded)


def check_parameter_layouts(cfg, sharded):
    """Every parameter of `cfg` under the case's strategy has the layout its rules declare."""
    name, run = sharded
    declared = {path: spec for path, _, spec in param_layouts(cfg, get_strategy(name))}
    assert set(declared) == set(run["live_layouts"])
    for path, spec in declared.items():
        live = run["live_layouts"][path]
        assert live == normalize(spec, len(live)), f"{name}: {path} is {live}, declared {spec}"


def test_module_outputs_have_declared_layouts(sharded):
    name, run = sharded
    kinds = {kind for kind, _, _ in run["records"]}
    assert kinds == {"Einsum", "Embed", "Norm", "Attention", "Mlp", "Block"}
    for kind, declared, live in run["records"]:
        assert live == declared, f"{name}: a {kind} returned {live}, declared {declared}"


def test_strategy_actually_shards(sharded):
    # Guards the comparisons below against a strategy that silently replicates everything.
    name, run = sharded
    split = [p for p, spec in run["live_layouts"].items() if any(a is not None for a in spec)]
    if name == "dp":
        assert not split
    else:
        assert "blocks/attention/q/weight" in split and "blocks/mlp/down/weight" in split


def assert_step_equals_one_device(run, reference, scalars=("loss",)):
    """Logits, the `scalars` (the loss, ...) and every gradient within the module's bounds."""
    np.testing.assert_allclose(run["logits"], reference["logits"], atol=2e-5, rtol=0)
    for name in scalars:
        assert abs(run[name] - reference[name]) < 2e-5, name
    assert set(run["grads"]) == set(reference["grads"])
    for path, g in reference["grads"].items():
        np.testing.assert_allclose(run["grads"][path], g, atol=1e-5, rtol=1e-4, err_msg=path)


def assert_adamw_steps_equal_one_device(run, reference):
    ref = np.asarray(reference["adam_losses"])
    assert ref[-1] < ref[0] - 0.05, "the reference run should learn (loss falls)"
    np.testing.assert_allclose(run["adam_losses"], ref, rtol=1e-4, atol=0)


def test_logits_loss_grads_equal_one_device(sharded, reference):
    assert_step_equals_one_device(sharded[1], reference)


def test_adamw_steps_equal_one_device(sharded, reference):
    assert_adamw_steps_equal_one_device(sharded[1], reference)
