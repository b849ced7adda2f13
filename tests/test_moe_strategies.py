"""Every strategy that accepts an MoE model equals the one-device run: declared layouts are
the live ones, and logits, the training objective (NLL + weighted load-balancing loss), the aux
loss itself, gradients and ten AdamW steps agree.

Tolerances as for the dense models (test_strategies_equal_one_device.py): float32, split
contractions sum in another order: 2e-5 absolute on logits and losses, 1e-5 + 1e-4 relative
on gradients, 1e-4 relative on the ten-step loss sequence. Routing is discrete, but no token
sits within rounding of a top-k tie here (the aux loss, a function of the choices, agrees).
"""

from __future__ import annotations

import numpy as np
import pytest
import test_strategies_equal_one_device as equal
from flax import nnx

from nnx_zoo.training.loop import objective_from_nll
from shardings import get_strategy
from zoo import check_model_fits, get_config
from zoo.loss import token_nll

# 8 experts of 64, top 2; aux weight raised so its gradient is not lost in the NLL's.
CFG = get_config("qwen3-moe-tiny", router_aux_loss_coef=0.1)
# One case per way the experts are laid out: replicated, FSDP+TP-split, expert-split, and
# expert-split with F over `model` (the dropless test runs the all-to-all on other expert
# axes; the HF test on 2 and 4).
CASES = [("dp", (8,)), ("fsdp_tp", (4, 2)), ("fsdp_ep", (1, 8)), ("fsdp_tp_ep", (2, 2, 2))]


def objective_sum(logits_BTV, moe, batch, aux_coef: float):
    """The trainer's objective (training.loop.train_loss_sum) from the model's full logits."""
    nll_BT, mask_BT = token_nll(logits_BTV, batch["tokens"], batch["segment_ids"])
    return objective_from_nll(nll_BT, mask_BT, moe, aux_coef)


def _objective(model, batch):
    """The trainer's objective (NLL + weighted aux loss) and its gradients; the aux loss
    itself is compared too."""

    def loss_fn(model):
        logits, _, moe = model.forward(
            batch["tokens"], segment_ids=batch["segment_ids"], positions=batch["positions"]
        )
        total, (count, sums) = objective_sum(logits, moe, batch, CFG.router_aux_loss_coef)
        return total / count, (sums["aux_loss"] / count, logits)

    (loss, (aux, logits)), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    return loss, logits, grads, {"aux": aux}


def _run(strategy_name, mesh, init_params=None):
    return equal._run(strategy_name, mesh, init_params, cfg=CFG, objective=_objective)


reference, sharded = equal.equality_fixtures(_run, CASES)


def test_layouts_are_declared(sharded):
    name, run = sharded
    equal.check_parameter_layouts(CFG, sharded)
    assert "Moe" in {kind for kind, _, _ in run["records"]}
    for kind, want, live in run["records"]:
        assert live == want, f"{name}: a {kind} returned {live}, declared {want}"
    experts = run["live_layouts"]["blocks/moe/gate"]
    if name == "fsdp_ep":
        assert experts[1] == "expert"  # [L, E/expert, M/data, F]
    elif name == "fsdp_tp_ep":
        assert experts[1:] == ("expert", "data", "model")  # [L, E/expert, M/data, F/model]
    elif name != "dp":
        assert any(a is not None for a in experts)  # FSDP- or TP-split


def test_logits_loss_aux_grads_equal_one_device(sharded, reference):
    equal.assert_step_equals_one_device(sharded[1], reference, scalars=("loss", "aux"))


def test_adamw_steps_equal_one_device(sharded, reference):
    equal.assert_adamw_steps_equal_one_device(sharded[1], reference)


def test_aux_loss_reaches_the_router_gradient(reference):
    """The weighted aux loss is part of the objective: the router's gradient differs from
    the gradient of the NLL alone."""
    assert np.abs(reference["grads"]["blocks/moe/router/weight"]).max() > 0
    assert reference["aux"] > 1.0  # E * sum(f * p) >= 1, equality only when balanced


def test_default_mesh_and_divisibility_know_the_expert_count():
    ep = get_strategy("fsdp_ep")
    assert ep.default_mesh_shape(8, CFG) == (1, 8)  # 8 experts: all 8 devices on `expert`
    assert ep.default_mesh_shape(8, CFG.replace(num_experts=4)) == (2, 4)
    assert ep.default_mesh_shape(8, CFG.replace(num_experts=6)) == (4, 2)
    assert ep.default_mesh_shape(64, get_config("qwen3-30b-a3b")) == (8, 8)  # capped at 8
    assert ep.default_mesh_shape(8, get_config("tiny")) == (8, 1)  # dense: nothing to split
    # Dense strategies split each expert's F over `model` as they split the MLP's.
    assert get_strategy("tp").default_mesh_shape(8, CFG.replace(moe_ffn_dim=66)) == (4, 2)
    mesh = ep.make_mesh(shape=(1, 8))
    with pytest.raises(ValueError) as err:
        check_model_fits(CFG.replace(num_experts=4), ep, mesh)
    message = str(err.value)
    assert "\n" not in message and "expert=8" in message and "(size 4)" in message, message


def test_flops_count_only_the_active_experts():
    """Published sizes: Qwen3-30B-A3B 30.5B params, 3.3B active; Mixtral 8x7B 46.7B, 12.9B
    active (both counting the embedding). FLOPs per token are 6 x the active matmul params
    plus attention, so a model with all experts active would count E/k times the expert part."""
    for preset, total, active in (
        ("qwen3-30b-a3b", 30.5e9, 3.3e9),
        ("mixtral-8x7b", 46.7e9, 12.9e9),
    ):
        cfg = get_config(preset)
        assert abs(cfg.num_params() / total - 1) < 0.01, preset
        embedding = cfg.vocab_size * cfg.hidden_dim
        assert abs((cfg.matmul_params() + embedding) / active - 1) < 0.02, preset
        all_active = cfg.replace(num_experts_per_tok=cfg.num_experts)
        expert = 3 * cfg.hidden_dim * cfg.moe_ffn_dim * cfg.num_layers
        extra = 6 * expert * (cfg.num_experts - cfg.num_experts_per_tok)
        assert all_active.flops_per_token(128) - cfg.flops_per_token(128) == extra
