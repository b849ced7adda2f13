"""The step-time model counts DPO's reference forward (nnx_zoo/planning/estimate.py): one
more forward of every token, a third of the training formula; none for ORPO / SimPO / SFT.
A pair's two sequences share the batch's rows (docs/preference.md, "Packing"), so the step's
tokens already count both: the reference is the only FLOPs the config's formula leaves out.
Hand-checked on the model's functions, and once through a compiled plan (cpu:8, ~5 s)."""

from __future__ import annotations

import jax
import pytest

from nnx_zoo.planning.chips import chip_for
from nnx_zoo.planning.compile import Candidate, Target, compile_plan, has_reference
from nnx_zoo.planning.estimate import (
    estimate_step,
    forecast_step,
    quantized_flops_per_token,
    reference_flops_per_token,
)
from nnx_zoo.training.config import RunConfig
from zoo import get_config

CFG = get_config("tiny", hidden_dim=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64)
T, B, N = 512, 16, 8
H100 = chip_for("h100:8")


def _run(objective: str, **more) -> RunConfig:
    pairs = objective != "sft"
    return RunConfig.from_config_dict(
        {
            "model": {"preset": "tiny", "hidden_dim": 64, "num_layers": 2, "head_dim": 8},
            "data": {
                "seq_len": 32,
                "global_batch_size": 8,
                **({"format": "preference"} if pairs else {}),
            },
            "training": {"objective": objective},
            **more,
        }
    )


@pytest.mark.parametrize(
    "objective, more, expected",
    [
        ("sft", {}, False),
        ("dpo", {}, True),
        ("dpo", {"lora": {"rank": 4}}, True),  # the base without adapters: a whole forward
        ("orpo", {}, False),
        ("simpo", {}, False),
    ],
)
def test_only_dpo_has_a_reference_forward(objective, more, expected):
    assert has_reference(_run(objective, **more)) is expected


def _estimate(reference: bool, remat: str = "full"):
    common = dict(seq_len=T, global_batch=B, num_devices=N, remat=remat, chip=H100)
    return estimate_step(CFG, **common, exposed_comm=0.0, overlapped_comm=0.0, reference=reference)


def _forecast(reference: bool, flash: bool = True):
    return forecast_step(
        CFG,
        seq_len=T,
        global_batch=B,
        num_devices=N,
        micro_batches=1,
        tensor_parallel=1,
        remat="full",
        chip=H100,
        flash=flash,
        memory_bytes=1e9,
        kernels=100,
        exposed_comm=0.0,
        overlapped_comm=0.0,
        reference=reference,
    )


def test_the_reference_forward_is_a_third_of_the_training_formula():
    per_token = reference_flops_per_token(CFG, T, True)
    # 2 FLOPs per matmul weight + the attention forward (4 N D per key), by hand.
    attention = sum(4.0 * CFG.num_heads * CFG.head_dim * (T + 1) / 2 for _ in range(CFG.num_layers))
    assert per_token == pytest.approx(2.0 * CFG.matmul_params() + attention)
    assert reference_flops_per_token(CFG, T, False) == 0.0
    extra = per_token * B * T / N
    for remat in ("none", "full"):  # no backward and no recompute: the same under any policy
        sft, dpo = _estimate(False, remat), _estimate(True, remat)
        assert dpo.executed_flops - sft.executed_flops == pytest.approx(extra)
        assert dpo.model_flops - sft.model_flops == pytest.approx(extra)
        assert dpo.compute_seconds > sft.compute_seconds
    for flash in (True, False):
        sft, dpo = _forecast(False, flash), _forecast(True, flash)
        added = dpo.matmul_flops + dpo.attention_flops - sft.matmul_flops - sft.attention_flops
        assert added == pytest.approx(extra)
        # Its attention is a forward: 4 N D per key seen, whatever the backward would cost.
        assert dpo.attention_flops - sft.attention_flops == pytest.approx(attention * B * T / N)
        assert dpo.step_seconds > sft.step_seconds
    # Quantized projections: 2 more FLOPs per weight, as the forward runs them.
    fp8 = get_config("tiny", quantization="fp8")
    assert quantized_flops_per_token(fp8, "full", True) - quantized_flops_per_token(
        fp8, "full"
    ) == pytest.approx(quantized_flops_per_token(fp8, "none") / 3)


def test_a_compiled_dpo_plan_counts_the_reference():
    run = _run("dpo")
    target = Target("cpu:8", tuple(jax.devices()), chip_for("cpu", memory_gib=16))
    plan = compile_plan(run, Candidate("fsdp", (8,), "full", 1), target)
    cfg, data = run.model.decoder_config(), run.data
    without = estimate_step(
        cfg,
        seq_len=data.seq_len,
        global_batch=data.global_batch_size,
        num_devices=8,
        remat="full",
        chip=target.chip,
        exposed_comm=0.0,
        overlapped_comm=0.0,
    )
    extra = cfg.flops_per_token(data.seq_len) / 3 * data.seq_len * data.global_batch_size / 8
    assert plan.estimate.executed_flops - without.executed_flops == pytest.approx(extra)
