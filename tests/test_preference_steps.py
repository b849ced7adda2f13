"""DPO through train_main (issue 51, goal 3 and item 3): ten steps under fsdp_tp, the
pipeline strategy fsdp_pp and the context-parallel fsdp_cp equal the one-device run, TRL's
metrics in metrics.jsonl; the reference without LoRA is a frozen copy that the step takes
as an argument, and with LoRA the base itself (the adapters zeroed, no copy).

Tolerance: float32; Adam steps amplify the reassociation of split sums (as in
tests/test_strategies_equal_one_device.py): 1e-4 relative on the loss sequence.

Ten steps, the issue's count (a step costs ~0.5 s here and each run pays for every one):
step 1's loss is taken before any update, so steps 2-10 are nine updates whose losses and
rewards must agree, which is where a layout bug in the gradient or the reference shows.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _train_helpers import SMALL_RUN, cli_flags, run_train_main
from flax import nnx
from test_preference_data import _pairs, _write

from nnx_zoo.training import preference

RUN = {
    **SMALL_RUN,
    "data.seq_len": 128,
    "data.global_batch_size": 8,
    "training.steps": 10,
    "training.eval_every": 0,
    "training.loss_chunk_size": 0,
    "optimizer.warmup_steps": 0,
    "data.validation_fraction": 0.1,
}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("dpo") / "pairs.jsonl", _pairs(64))


def _dpo_run(source, workdir, strategy, num_devices=None, more=None) -> list[dict]:
    result = run_train_main(
        [
            "--config=configs/tiny.py",
            f"--workdir={workdir}",
            f"--sharding_strategy={strategy}",
            *cli_flags({**RUN, **(more or {})}),
            f"--config.data.source={source}",
            "--config.data.format=preference",
            "--config.training.objective=dpo",
        ],
        num_devices=num_devices,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "loss" in r]


@pytest.fixture(scope="module")
def one_device(source, tmp_path_factory):
    return _dpo_run(source, tmp_path_factory.mktemp("one"), "dp", num_devices=1)


def test_one_device_run_logs_trl_metrics(one_device):
    first, last = one_device[0], one_device[-1]
    assert len(one_device) == RUN["training.steps"]
    # The policy starts as its reference: every pair's loss is log 2, every reward 0.
    assert first["loss"] == pytest.approx(np.log(2), rel=1e-6)
    assert abs(first["rewards/margins"]) < 1e-5
    assert last["loss"] < first["loss"] and last["rewards/margins"] > 0
    for name in preference.METRICS:
        assert np.isfinite(last[name]), name


@pytest.mark.parametrize("strategy", ["fsdp_tp", "fsdp_pp", "fsdp_cp", "dp_micro_batches"])
def test_dpo_steps_equal_one_device(source, one_device, tmp_path, strategy):
    if strategy == "dp_micro_batches":  # two micro-batches, the reference in each
        run = _dpo_run(source, tmp_path, "dp", 1, {"optimizer.micro_batches": 2})
    else:
        run = _dpo_run(source, tmp_path, strategy)
    for key in ("loss", "rewards/chosen", "rewards/rejected", "logps/chosen"):
        want = np.array([r[key] for r in one_device])
        got = np.array([r[key] for r in run])
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6, err_msg=key)


def _pair_batch(rng):
    """Two rows of two pairs each, every sequence 4 prompt then 4 answer tokens."""
    tokens = rng.integers(3, 200, (2, 32)).astype(np.int32)
    segments = np.repeat([[1] * 8 + [2] * 8 + [3] * 8 + [4] * 8], 2, axis=0).astype(np.int32)
    return {
        "tokens": jnp.asarray(tokens),
        "segment_ids": jnp.asarray(segments),
        "positions": jnp.asarray(np.tile(np.arange(8), (2, 4)), jnp.int32),
        "loss_mask": jnp.asarray(np.tile([0] * 4 + [1] * 4, (2, 4)), jnp.int32),
    }


def test_lora_reference_is_the_base_with_adapters_off():
    """With LoRA the reference is the model with its adapters zeroed: the base model's
    numbers, from the same (not copied) weights, however far the adapters have moved."""
    from nnx_zoo.training.preference import Objective, frozen_copy, loss_sum
    from shardings import get_strategy
    from zoo import create_model, get_config
    from zoo.layers.lora import LoraConfig, LoraParam, add_lora

    rng = np.random.default_rng(0)
    batch = _pair_batch(rng)
    strategy = get_strategy("dp")
    cfg = get_config("tiny", hidden_dim=32, num_layers=2, head_dim=8, ffn_dim=64, vocab_size=256)
    objective = Objective("dpo", dpo_beta=0.5)
    with jax.set_mesh(strategy.make_mesh(devices=jax.devices()[:1])):
        model = create_model(cfg, strategy, rngs=nnx.Rngs(0))
        base = frozen_copy(model)
        add_lora(model, LoraConfig(rank=4, alpha=8.0), nnx.Rngs(1))
        assert frozen_copy(model) is None  # LoRA: no second set of weights
        for _, var in nnx.to_flat_state(nnx.state(model, LoraParam)):  # adapters that moved
            var.set_value(var[...] + 0.05 * jnp.asarray(rng.normal(size=var[...].shape)))

        @jax.jit
        def both(model, batch, base):
            off = loss_sum(objective, model, batch)
            return off, loss_sum(objective, model, batch, reference=base)

        adapters_off, base_copy = both(model, batch, base)
    assert float(adapters_off[1][1]["rewards/margins"]) != 0.0
    for got, want in zip(jax.tree.leaves(adapters_off), jax.tree.leaves(base_copy), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_1f1b_exits_2_naming_why(source, tmp_path):
    result = run_train_main(
        [
            "--config=configs/tiny.py",
            f"--workdir={tmp_path}",
            "--sharding_strategy=fsdp_pp",
            *cli_flags(RUN),
            f"--config.data.source={source}",
            "--config.data.format=preference",
            "--config.training.objective=dpo",
            "--config.model.pipeline_schedule=1f1b",
        ]
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot run under model.pipeline_schedule=1f1b" in lines[0]


def test_the_plan_counts_the_reference(tmp_path):
    """The compiled step's argument bytes: LoRA-DPO holds one set of base weights (within 5%
    of LoRA-SFT's), full DPO one more copy of the parameters than full SFT."""
    from _train_helpers import run_config

    from bench.fixtures import write_tiny_llama
    from nnx_zoo.launch.build import build
    from nnx_zoo.training.step_memory import step_memory

    base = str(tmp_path / "base")
    write_tiny_llama(base, "llama", max_seq_len=128)
    shapes = {"data.seq_len": 128, "data.global_batch_size": 8, "training.sharding_strategy": "dp"}
    dpo = {"data.format": "preference", "training.objective": "dpo"}

    def argument_bytes(overrides):
        built = build(run_config({**shapes, **overrides}), abstract=True, init_from=base)
        compiled, _ = built.compile()
        return step_memory(compiled).argument_bytes, built

    lora = {"lora.rank": 8}
    lora_sft, _ = argument_bytes(lora)
    lora_dpo, built = argument_bytes({**lora, **dpo})
    assert built.trainer.ref_state is None
    assert abs(lora_dpo - lora_sft) <= 0.05 * lora_sft
    sft, built = argument_bytes({})
    full_dpo, _ = argument_bytes(dpo)
    params = sum(
        x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(built.model, nnx.Param))
    )
    # one more copy of the parameters (of 1 device's share: dp replicates them)
    assert abs(full_dpo - sft - params) <= 0.05 * params


def test_dpo_sigkilled_then_resumed_equals_uninterrupted(source, tmp_path):
    """A DPO run SIGKILLed mid-run, as soon as its first checkpoint is complete, then started
    again on its workdir, equals the uninterrupted run bit for bit (float32; the values as
    metrics.jsonl wrote them): the reference is rebuilt from the starting weights, not from
    the restored policy, and the pairs resume where the checkpoint left them. Only the killed
    run is a process of its own (tests/test_resume.py does the same for SFT under fsdp_tp,
    with SIGTERM too)."""
    import signal
    import subprocess

    from _train_helpers import start_train_main
    from test_resume import wait_for

    from nnx_zoo.checkpoint.steps import checkpoint_dir, complete_steps

    # 9 steps (each ~0.3 s and a save every 3) after the first save, polled every 20 ms:
    # the kill lands mid-run; 12, not more, as both in-process runs pay for every step.
    steps, every = 12, 3
    args = [
        "--config=configs/tiny.py",
        "--sharding_strategy=dp",
        *cli_flags({**RUN, "training.steps": steps, "checkpoint.enabled": True}),
        f"--config.checkpoint.every={every}",
        f"--config.data.source={source}",
        "--config.data.format=preference",
        "--config.training.objective=dpo",
    ]

    def run(workdir):
        result = run_train_main([f"--workdir={workdir}", *args], num_devices=1)
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout + result.stderr

    def history(workdir):  # the training lines, in the order written
        with open(os.path.join(workdir, "metrics.jsonl")) as f:
            return [r for r in map(json.loads, f) if "loss" in r]

    run(tmp_path / "whole")
    workdir, log = str(tmp_path / "killed"), str(tmp_path / "killed.log")
    ckpts = checkpoint_dir(workdir)
    with open(log, "w") as out:
        # The in-process runs' program: 8 host devices, the run on the first
        # (training.num_devices=1, as run_train_main passes it).
        proc = start_train_main(
            [f"--workdir={workdir}", *args, "--config.training.num_devices=1"],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        wait_for(lambda: complete_steps(ckpts, warn=False), proc, "the first checkpoint", log)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=600) == -signal.SIGKILL
    killed_after = max(r["step"] for r in history(workdir))
    resume_from = complete_steps(ckpts)[-1]
    assert resume_from < steps and killed_after < steps  # killed mid-run
    assert f"resumed from step {resume_from}" in run(workdir)

    keys = ("step", "loss", "grad_norm", "learning_rate", "tokens_seen", "loss_tokens")
    keys += ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "logps/chosen")
    want, got = history(tmp_path / "whole"), history(workdir)
    # Each step once: the lines the killed run wrote after its checkpoint were dropped.
    assert [r["step"] for r in got] == list(range(1, steps + 1))
    for w, g in zip(want, got, strict=True):
        assert {k: g[k] for k in keys} == {k: w[k] for k in keys}, w["step"]


def test_moe_objectives_add_the_policy_router_loss():
    """An MoE model (qwen3-moe-tiny, router_aux_loss_coef 0.01): each objective's loss is its
    mean over pairs plus coef x the policy's load-balancing loss, the latter computed here
    from the policy's own forward (TRL: `loss + router_aux_loss_coef * outputs.aux_loss`);
    the DPO step logs `aux_loss` and the router's load as SFT does, and validation leaves the
    aux loss out (as SFT's val_loss). The reference is moved off the policy, so its routing,
    which is not a training signal, differs from the policy's."""
    from _train_helpers import run_config

    from nnx_zoo.launch.build import build
    from nnx_zoo.training.preference import Objective, loss_sum

    run = run_config(
        {
            "model.preset": "qwen3-moe-tiny",
            "data.seq_len": 32,
            "data.global_batch_size": 2,
            "training.sharding_strategy": "dp",
            "training.loss_chunk_size": 0,
            "data.format": "preference",
            "training.objective": "dpo",
        }
    )
    built = build(run, devices=jax.devices()[:1])
    trainer, coef = built.trainer, built.model_cfg.router_aux_loss_coef
    assert coef == 0.01
    # The reference: the starting weights scaled by 1.1 (DPO's rewards and the reference's
    # routing then differ from the policy's).
    trainer.ref_state = jax.tree.map(lambda x: x * 1.1, trainer.ref_state)
    batch = _pair_batch(np.random.default_rng(0))
    names = ("dpo", "orpo", "simpo")
    with jax.set_mesh(built.mesh):

        @jax.jit
        def separately(state, ref_state, batch):
            """Each objective's pair loss and the policy's aux loss, from one policy and one
            reference forward; ORPO's and SimPO's loss_sum (DPO's: the step's)."""
            model, _ = nnx.merge(trainer.graphdef, state)
            model = nnx.view(model, deterministic=True, raise_if_not_found=False)
            kw = dict(packed=True, chunk_size=0)
            policy, stats = preference.model_pair_logps(model, batch, **kw)
            ref_model = nnx.merge(trainer.ref_graphdef, ref_state)
            ref, _ = preference.model_pair_logps(ref_model, batch, **kw)
            plain = {n: preference.objective_sums(Objective(n), policy, ref) for n in names}
            summed = {n: loss_sum(Objective(n), model, batch, **kw) for n in names[1:]}
            return stats.aux_loss, plain, summed

        aux, plain, summed = separately(trainer.state, trainer.ref_state, batch)
        val_total, val_count = trainer.eval_step(batch)
        summed["dpo"] = trainer.train_step(batch)  # the loss before its update, and the means
    aux = float(aux)
    assert 0.5 < aux < 8.0  # E * sum(f * p), ~1 when balanced: a real router's
    moe_metrics = {"aux_loss", "expert_load", "moe_load_spread", "moe_dropped"}
    for name in names:
        pair_total, (count, pair_sums) = plain[name]
        preference_loss = float(pair_total / count)
        if name == "dpo":  # the step: means over the pairs
            metrics = jax.device_get(summed[name])
            loss, logged_aux = float(metrics["loss"]), float(metrics["aux_loss"])
            assert moe_metrics <= set(metrics) and metrics["expert_load"].shape == (8,)
            assert abs(float(pair_sums["rewards/margins"])) > 1e-4  # the reference moved
            # validation: the objective alone
            np.testing.assert_allclose(float(val_total / val_count), preference_loss, rtol=1e-5)
        else:
            total, (count, sums) = summed[name]
            loss, logged_aux = float(total / count), float(sums["aux_loss"] / count)
            # ... and each layer's load, which the train step takes for the routers' bias.
            assert set(sums) - set(pair_sums) == moe_metrics | {"moe_layer_load"}, name
        np.testing.assert_allclose(loss, preference_loss + coef * aux, rtol=1e-5, err_msg=name)
        np.testing.assert_allclose(logged_aux, aux, rtol=1e-5, err_msg=name)
