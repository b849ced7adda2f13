"""Mixture-of-experts models under the pipeline strategies equal the one-device run.

Each MoE layer returns its routing sums (zoo/layers/stage.py's `Stack.stats`); the schedules
add them up over micro-batches in layer order, so the load-balancing loss, which GPipe and
the circular schedule differentiate, and each layer's expert load are the whole batch's.
DeepSeek-V3's dense first layers run before the schedule (`before_stack`), on each stage's
own rows. Cases: Qwen3-MoE under fsdp_pp (GPipe) and under fsdp_ep_pp (circular, experts
over `expert` inside each stage), DeepSeek-V3 under fsdp_ep_pp (GPipe), and DeepSeek-V3
under 1F1B, which returns the sums but no gradient of them (it refuses a weighted aux loss).

Tolerances are test_strategies_equal_one_device.py's (float32; split contractions and the
micro-batches' sums add in another order): 2e-5 absolute on logits and losses, 1e-5 + 1e-4
relative on gradients, 1e-4 relative on the ten-step AdamW loss sequence.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_strategies_equal_one_device as equal
from flax import nnx
from model_utils import build_with_params, host_params, one_device_mesh, packed_batch, put_batch
from test_deepseek_v3 import train_and_check_bias_updates
from test_moe_strategies import objective_sum

from nnx_zoo.errors import UsageError
from shardings import get_strategy
from zoo import create_model, get_config, pipelined
from zoo.layers import pipeline

# (preset, strategy, mesh, micro-batches, repeats, layers)
CASES = [
    ("qwen3-moe-tiny", "fsdp_pp", (2, 4), 2, 1, 2),
    # Circular: chunks run out of storage order, so the sums come back reordered.
    ("qwen3-moe-tiny", "fsdp_ep_pp", (2, 1, 4), 2, 2, 4),
    # 3 layers: 1 dense before the schedule, 2 MoE layers in it (one per stage).
    ("deepseek-v3-tiny", "fsdp_ep_pp", (2, 2, 2), 2, 1, 3),
]
AUX = 0.1  # raised so that its gradient is not lost in the NLL's
# A fixed weighting of each layer's load `[L, E]`: one scalar that differs when any layer's
# loads are wrong or land on another layer.
_LOAD_WEIGHTS = np.random.default_rng(0).normal(size=(4, 8)).astype(np.float32)


def _config(preset, layers, **changes):
    return get_config(preset, router_aux_loss_coef=AUX, num_layers=layers).replace(**changes)


def _objective(model, batch):
    """The trainer's objective (NLL + weighted aux loss), the stack run by the model's
    pipeline plan (one device: none); the aux loss and a weighting of the loads compared
    too."""
    pp = pipeline.plan_for(model.cfg, model.sharding, jax.sharding.get_abstract_mesh())

    def loss_fn(model):
        logits, _, moe = pipelined.forward(
            model,
            pp,
            batch["tokens"],
            segment_ids=batch["segment_ids"],
            positions=batch["positions"],
        )
        total, (count, sums) = objective_sum(logits, moe, batch, model.cfg.router_aux_loss_coef)
        L = moe.load.shape[0]
        weighted = jnp.sum(moe.load * _LOAD_WEIGHTS[:L])
        return total / count, (sums["aux_loss"] / count, weighted, logits)

    (loss, (aux, load, logits)), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    return loss, logits, grads, {"aux": aux, "load": load}


@pytest.fixture(scope="module")
def references():
    runs = {}

    def get(preset, layers):
        if (preset, layers) not in runs:
            cfg = _config(preset, layers)
            runs[preset, layers] = equal._run(
                "dp", one_device_mesh(), cfg=cfg, objective=_objective
            )
        return runs[preset, layers]

    return get


@pytest.fixture(
    scope="module",
    params=CASES,
    ids=[f"{p}-{s}-{'x'.join(map(str, m))}-mb{mb}-r{r}" for p, s, m, mb, r, _ in CASES],
)
def case(request, references):
    preset, name, shape, microbatches, repeats, layers = request.param
    reference = references(preset, layers)
    cfg = _config(preset, layers, pipeline_microbatches=microbatches, pipeline_repeats=repeats)
    mesh = get_strategy(name).make_mesh(shape=shape)
    run = equal._run(name, mesh, init_params=reference["params"], cfg=cfg, objective=_objective)
    return name, run, reference


def test_layouts_are_declared_and_the_stack_is_split_over_stage(case):
    name, run, _ = case
    for kind, want, live in run["records"]:
        assert live == want, f"{name}: a {kind} returned {live}, declared {want}"
    assert "Moe" in {kind for kind, _, _ in run["records"]} or "GroupedMoe" in {
        kind for kind, _, _ in run["records"]
    }
    for path, spec in run["live_layouts"].items():
        if path.startswith("blocks/"):
            assert spec[0] == "stage", f"{name}: {path} is {spec}"
        elif path.startswith("dense_blocks/"):
            # Before the schedule: L whole, the matrices FSDP over stage as well (norm
            # scales stay replicated, as everywhere).
            assert spec[0] is None, f"{name}: {path} is {spec}"
            if len(spec) > 2:
                assert "stage" in str(spec), f"{name}: {path} is {spec}"
    if name == "fsdp_ep_pp":
        experts = run["live_layouts"]["blocks/moe/gate"]
        assert experts[:2] == ("stage", "expert"), experts  # [L/stage, E/expert, M, F]


def test_logits_loss_aux_load_grads_equal_one_device(case):
    _, run, reference = case
    equal.assert_step_equals_one_device(run, reference, scalars=("loss", "aux", "load"))


def test_adamw_steps_equal_one_device(case):
    _, run, reference = case
    equal.assert_adamw_steps_equal_one_device(run, reference)


def _nll_and_load(model, batch, pp):
    def loss_fn(model):
        out = pipelined.nll_sum(
            model,
            pp,
            batch["tokens"],
            segment_ids=batch["segment_ids"],
            positions=batch["positions"],
        )
        return out.total / out.count, out.router_stats.load

    return nnx.value_and_grad(loss_fn, has_aux=True)(model)


def test_1f1b_gives_the_loss_gradients_and_loads_of_one_device():
    """DeepSeek-V3's routing needs no aux loss (its balance is the bias update, fed by the
    loads), so 1F1B runs it: loss, gradients and per-layer loads equal one device."""
    cfg = _config("deepseek-v3-tiny", 3, router_aux_loss_coef=0.0)
    batch_np = packed_batch(batch=8, seq=32, vocab=cfg.vocab_size)
    results = []
    for name, mesh, changes in (
        ("dp", one_device_mesh(), {}),
        (
            "fsdp_ep_pp",
            get_strategy("fsdp_ep_pp").make_mesh(shape=(2, 2, 2)),
            {"pipeline_schedule": "1f1b", "pipeline_microbatches": 2},
        ),
    ):
        strategy = get_strategy(name)
        run_cfg = cfg.replace(**changes)
        with jax.set_mesh(mesh):
            if not results:
                model = create_model(run_cfg, strategy, rngs=nnx.Rngs(0))
                params = host_params(model)
            else:

                def build(run_cfg=run_cfg, strategy=strategy):
                    return create_model(run_cfg, strategy, rngs=nnx.Rngs(0))

                model = build_with_params(build, params, mesh)
            pp = pipeline.plan_for(run_cfg, model.sharding, jax.sharding.get_abstract_mesh())
            assert (pp is None) == (name == "dp")
            batch = put_batch(batch_np, strategy.batch_spec())
            (loss, load), grads = nnx.jit(_nll_and_load, static_argnums=2)(model, batch, pp)
            results.append(
                (
                    float(loss),
                    np.asarray(load),
                    {
                        "/".join(map(str, p)): np.asarray(v[...])
                        for p, v in nnx.to_flat_state(nnx.state(grads, nnx.Param))
                    },
                )
            )
    (want_loss, want_load, want_grads), (got_loss, got_load, got_grads) = results
    np.testing.assert_allclose(got_loss, want_loss, atol=2e-5)
    assert got_load.shape == (2, 8) and np.all(got_load.sum(-1) > 0.999)
    np.testing.assert_allclose(got_load, want_load, atol=1e-6)
    assert want_grads.keys() == got_grads.keys()
    for path, want in want_grads.items():
        np.testing.assert_allclose(got_grads[path], want, rtol=1e-4, atol=1e-5, err_msg=path)


def test_1f1b_refuses_a_weighted_aux_loss_in_one_line():
    cfg = _config("qwen3-moe-tiny", 2, pipeline_schedule="1f1b")
    strategy = get_strategy("fsdp_pp")
    mesh = strategy.make_mesh(shape=(2, 4))
    with pytest.raises(UsageError) as err:
        pipeline.plan_for(cfg, strategy.lm_sharding(), mesh)
    message = str(err.value)
    assert "\n" not in message and "router_aux_loss_coef=0.1" in message
    assert "router_aux_loss_coef=0" in message and "gpipe" in message
    # Without the aux loss it plans.
    assert pipeline.plan_for(cfg.replace(router_aux_loss_coef=0.0), strategy.lm_sharding(), mesh)


def test_train_main_deepseek_under_fsdp_ep_pp_moves_the_routing_bias(tmp_path):
    """train_main under fsdp_ep_pp on the default mesh (stage 2 x expert 4: stacked_layers,
    not num_layers, sets the stage count): the loads the schedule sums feed DeepSeek's bias
    update as under fsdp_ep."""
    _, out = train_and_check_bias_updates(tmp_path, "fsdp_ep_pp")
    assert "fsdp_ep_pp on mesh {'stage': 2, 'data': 1, 'expert': 4}" in out, out[:1500]
