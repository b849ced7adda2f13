"""model.quantization compiled for the chips, without them: the step's matmuls take the
low-precision operands (plan_main's `dot_dtypes`), and the forecast runs them at that
precision's peak.

Llama 3.2 1B with fp8 for 8 H100s (short rows: the dots are the same at any length): every
projection (q, k, v, o, gate, up, down; one scanned block) is an fp8 GEMM forward (e4m3 x
e4m3) and in both backward products (e5m2 gradients against e4m3 weights / activations); only
the LM head (forward, recomputed forward, dx, dw) stays bf16. Its FSDP all-gathers of those
weights move the e4m3 values (one byte each, half of bf16's). The tiny model with int8, for a
v6e:4x4 slice and for 8 H100s: the projections are s8 x s8 dots. Without quantization neither
appears (tests/test_plan_targets.py checks that on its plans). fp8 on a TPU before v7, which
has no fp8 matrix unit, still compiles (the TPU compiler takes the f8 dots), and the planner
counts those dots at the bf16 rate, so fp8 there forecasts no speed-up.
"""

import pytest

from nnx_zoo.planning.chips import CHIPS
from nnx_zoo.planning.compile import Candidate, compile_plan, make_target
from nnx_zoo.training.config import RunConfig

PROJECTIONS = 7  # q, k, v, o, gate, up, down


def _run(preset, quantization, **data):
    model = dict(preset=preset, dtype="bfloat16", attention_impl="auto", remat="dots")
    return RunConfig.from_config_dict(
        {"model": {**model, "quantization": quantization}, "data": data}
    )


@pytest.mark.gpu_compile
def test_llama3_1b_fp8_on_h100_has_fp8_gemms_for_every_projection_both_ways():
    run = _run("llama3.2-1b", "fp8", seq_len=256, global_batch_size=8)
    plan = compile_plan(run, Candidate("fsdp", (8,), "dots", 1), make_target("h100:8"))
    # FSDP gathers the quantized weight: the layer loop's all-gathers carry e4m3 only, one
    # byte per projection weight element, gathered for the forward and again for the
    # backward (remat=dots keeps no gathered weight). The same plan without quantization
    # gathers them in bf16: 2 bytes each (measured: 3.89 GB, here 1.95 GB; README).
    cfg = run.model.decoder_config()
    q_o = cfg.hidden_dim * cfg.num_heads * cfg.head_dim
    k_v = cfg.hidden_dim * cfg.num_kv_heads * cfg.head_dim
    projection_weights = 2 * q_o + 2 * k_v + 3 * cfg.hidden_dim * cfg.ffn_dim  # + gate, up, down
    L = cfg.num_layers
    layer_gathers = [c for c in plan.collectives if c.op == "all-gather" and c.executions == L]
    assert layer_gathers and all(c.dtypes == ("f8e4m3fn",) for c in layer_gathers), layer_gathers
    assert sum(c.executions * c.array_bytes for c in layer_gathers) == 2 * L * projection_weights
    dots = plan.to_json()["dot_dtypes"]
    assert dots.get("f8e4m3fn x f8e4m3fn") == PROJECTIONS, dots  # forward
    assert dots.get("f8e5m2 x f8e4m3fn") == PROJECTIONS, dots  # dx = dy . w
    assert dots.get("f8e4m3fn x f8e5m2") == PROJECTIONS, dots  # dw = x . dy
    assert set(dots) - {"f8e4m3fn x f8e4m3fn", "f8e5m2 x f8e4m3fn", "f8e4m3fn x f8e5m2"} == {
        "bf16 x bf16"
    }
    # The LM head only (chunked loss): forward, its recomputed forward, dx, dw.
    assert dots["bf16 x bf16"] <= 4, dots
    # The forecast: projections at H100's fp8 peak, MFU stated against both peaks.
    h100 = CHIPS["h100"]
    est = plan.estimate
    assert 0 < est.quantized_flops < est.executed_flops
    assert est.mfu_at_precision == pytest.approx(
        est.mfu * h100.peak_bf16_flops / h100.peak_fp8_flops
    )
    bf16_compute = est.executed_flops / h100.peak_bf16_flops
    assert est.compute_seconds < bf16_compute


@pytest.mark.tpu_compile
def test_tiny_int8_on_v6e_has_s8_dots():
    run = _run("tiny", "int8", seq_len=128, global_batch_size=16)
    target = make_target("v6e:4x4")
    plan = compile_plan(run, Candidate("fsdp", (16,), "dots", 1), target)
    dots = plan.to_json()["dot_dtypes"]
    assert dots.get("s8 x s8", 0) >= 3 * PROJECTIONS, dots
    assert not any("f8" in k for k in dots), dots
    assert plan.estimate.mfu_at_precision == pytest.approx(plan.estimate.mfu / 2)


@pytest.mark.tpu_compile
def test_tiny_fp8_on_v5p_compiles_and_plans_at_the_bf16_rate():
    run = _run("tiny", "fp8", seq_len=128, global_batch_size=16)
    plan = compile_plan(run, Candidate("fsdp", (8,), "dots", 1), make_target("v5p:2x2x2"))
    dots = plan.to_json()["dot_dtypes"]
    assert dots.get("f8e4m3fn x f8e4m3fn", 0) >= PROJECTIONS, dots
    assert CHIPS["v5p"].peak_fp8_flops is None  # no fp8 rate: peak_flops falls back to bf16
    assert plan.estimate.mfu_at_precision == pytest.approx(plan.estimate.mfu)


@pytest.mark.gpu_compile
def test_tiny_int8_on_h100_has_s8_dots_for_every_projection():
    # XLA GPU merges dots that share an operand (q/k/v, gate/up: one dot each), so the count
    # of s8 dots is below 3 x 7; what shows a projection left in bf16 is a bf16 dot beyond
    # the LM head's four.
    run = _run("tiny", "int8", seq_len=128, global_batch_size=8)
    plan = compile_plan(run, Candidate("fsdp", (8,), "dots", 1), make_target("h100:8"))
    dots = plan.to_json()["dot_dtypes"]
    assert set(dots) == {"s8 x s8", "bf16 x bf16"} and dots["bf16 x bf16"] <= 4, dots
    assert dots["s8 x s8"] >= 12, dots  # forward: q/k/v, o, gate/up, down; dx and dw of each
    h100 = CHIPS["h100"]
    assert plan.estimate.mfu_at_precision == pytest.approx(
        plan.estimate.mfu * h100.peak_bf16_flops / h100.peak_int8_flops
    )
