"""Tiny's train step compiled for a TPU slice and a GPU host, with no such hardware here: the
compile succeeds, and the collectives XLA inserted are those `shardings/strategies.py`
promises for each strategy (however each target spells them)."""

import pytest

from nnx_zoo.planning.compile import Candidate, compile_plan, make_target
from nnx_zoo.training.config import RunConfig
from shardings import get_strategy

NAMES = ("dp", "fsdp", "tp", "fsdp_tp")


def _run() -> RunConfig:
    return RunConfig.from_config_dict(
        {
            "model": {"preset": "tiny", "dtype": "bfloat16", "remat": "full"},
            "data": {"seq_len": 128, "global_batch_size": 16},
        }
    )


def _compile_all(topology):
    run, target = _run(), make_target(topology)
    cfg = run.model.decoder_config()
    plans = {}
    for name in NAMES:
        shape = get_strategy(name).default_mesh_shape(8, cfg)
        plans[name] = compile_plan(run, Candidate(name, shape, "full", 1), target)
    return plans, cfg


# Each fixture is the slowest of its leg after the process tests (the GPU one 32 s on the
# floor leg, 48 s on the newest, 2026-11-27): the tiny step compiled for a real 8-chip target
# under every strategy in NAMES, by libtpu / the CUDA plugin. Every test of the module reads
# those plans (collectives, memory, kernels per strategy); each compile is needed once.
@pytest.fixture(scope="module")
def tpu_plans():
    return _compile_all("v5p:2x2x2")


@pytest.fixture(scope="module")
def gpu_plans():
    return _compile_all("h100:8")


def _bytes(plan, ops, axis):
    """Array bytes per step of the collectives `ops` that cross mesh axis `axis`."""
    return sum(
        c.executions * c.array_bytes for c in plan.collectives if c.op in ops and axis in c.axes
    )


def _check_promises(plans, cfg):
    weights_bf16 = 2 * cfg.matmul_params()  # every matmul weight, in the compute dtype
    for name, plan in plans.items():
        report = plan.to_json()["collectives_by_axis"]
        assert plan.peak_bytes > 0 and plan.fits, (name, plan.peak_bytes)
        # Every strategy splits the batch over `data`: gradients are reduced over it.
        grad_reduce = _bytes(plan, ("all-reduce", "reduce-scatter"), "data")
        assert grad_reduce > 0, (name, report)
        if name == "dp":
            # Weights replicated: nothing is ever gathered or scattered.
            assert _bytes(plan, ("all-gather", "reduce-scatter"), "data") == 0, report
            assert _bytes(plan, ("all-gather",), "model") == 0, report
        if name in ("fsdp", "fsdp_tp"):
            # Weights split over `data` are gathered for the forward pass, and again for the
            # backward (remat full): at least once per step at their full bf16 size (tp
            # splits them further over `model`, so divide by its size).
            model = plan.mesh.get("model", 1)
            assert _bytes(plan, ("all-gather",), "data") >= weights_bf16 / model, report
        if name == "tp":
            # No FSDP split: no weight is gathered over `data`.
            assert _bytes(plan, ("all-gather",), "data") == 0, report
        if name in ("tp", "fsdp_tp"):
            # Contractions over heads / FFN split on `model` end in a reduction over it.
            assert _bytes(plan, ("all-reduce", "reduce-scatter"), "model") > 0, report


@pytest.mark.tpu_compile
def test_tpu_slice_compiles_and_collectives_match_the_strategies(tpu_plans):
    _check_promises(*tpu_plans)


@pytest.mark.gpu_compile
def test_gpu_host_compiles_and_collectives_match_the_strategies(gpu_plans):
    _check_promises(*gpu_plans)


def _no_low_precision_dots(plans):
    """model.quantization='none': no fp8 or int8 matmul anywhere (test_quantization_compile
    has the quantized runs)."""
    for name, plan in plans.items():
        dots = plan.to_json()["dot_dtypes"]
        assert dots and not any("f8" in k or "s8" in k for k in dots), (name, dots)


@pytest.mark.tpu_compile
def test_tpu_plans_without_quantization_have_no_fp8_or_int8_dots(tpu_plans):
    _no_low_precision_dots(tpu_plans[0])


@pytest.mark.gpu_compile
def test_gpu_plans_without_quantization_have_no_fp8_or_int8_dots(gpu_plans):
    _no_low_precision_dots(gpu_plans[0])


@pytest.mark.gpu_compile
def test_step_time_comes_from_the_config_flops_not_xla(gpu_plans):
    plans, cfg = gpu_plans
    plan = plans["dp"]
    tokens = 16 * 128
    model_flops = cfg.flops_per_token(128) * tokens / 8
    assert plan.estimate.model_flops == pytest.approx(model_flops)
    # remat full recomputes each block's forward: more executed than model FLOPs.
    assert plan.estimate.executed_flops > model_flops
    assert 0 < plan.estimate.mfu < 1
    assert plan.estimate.step_seconds >= plan.estimate.compute_seconds


def _offload_check(plans, cfg, topology):
    """remat='offload' compiled for the target: the residual stream entering each sub-block
    (two per layer) lives in pinned host memory, all of it and nothing else, and the step
    recomputes what `full` does.

    Nothing else: every array in host memory is a residual stack [L, rows, T, M] or one
    layer's slice of it, in bf16. All of it: at least both stacks' bytes. The compiler may
    keep more copies of the same data there (a stack written in one layout and read in
    another), so the bytes are bounded, not exact: measured for tiny on v5p, libtpu 0.0.42.1
    keeps 2 stacks at L=2 and 3 at L=4 and 8, libtpu 0.0.50.1 keeps 4 at L=2 (it also copies
    the last layer's slices out and back) and 3 at L=4 and 8. Either way the chip holds none
    of it, which is what offload is for."""
    run, target = _run(), make_target(topology)
    full = plans["fsdp"]
    offload = compile_plan(run, Candidate("fsdp", full.candidate.mesh_shape, "offload", 1), target)
    rows_per_device = run.data.global_batch_size // full.mesh["data"]
    layer_dims = (rows_per_device, run.data.seq_len, cfg.hidden_dim)
    stack_dims = (cfg.num_layers, *layer_dims)
    stack_bytes = cfg.num_layers * rows_per_device * run.data.seq_len * cfg.hidden_dim * 2  # bf16
    residual = {f"bf16[{','.join(map(str, dims))}]" for dims in (stack_dims, layer_dims)}
    assert full.host_temp_bytes == 0 and full.host_arrays == []
    assert f"bf16[{','.join(map(str, stack_dims))}]" in offload.host_arrays, offload.host_arrays
    assert set(offload.host_arrays) <= residual, (offload.host_arrays, residual)
    assert 2 * stack_bytes <= offload.host_temp_bytes <= 4 * stack_bytes, (
        offload.host_temp_bytes,
        stack_bytes,
    )
    assert offload.estimate.executed_flops == full.estimate.executed_flops
    assert offload.fits and offload.to_json()["host_temp_bytes"] == offload.host_temp_bytes


@pytest.mark.tpu_compile
def test_offload_compiles_for_tpu_with_the_residual_stream_in_host_memory(tpu_plans):
    _offload_check(*tpu_plans, "v5p:2x2x2")


@pytest.mark.gpu_compile
def test_offload_compiles_for_gpu_with_the_residual_stream_in_host_memory(gpu_plans):
    _offload_check(*gpu_plans, "h100:8")


@pytest.mark.tpu_compile
def test_a_step_the_tpu_compiler_refuses_for_memory_is_a_plan_that_does_not_fit():
    """libtpu refuses, at compile time, a step whose temporaries exceed the chip's HBM. The
    planner reports it as a plan that does not fit (with the compiler's figure) and advises,
    never a stack trace. Tiny at 8192 tokens with XLA attention and no remat keeps every
    layer's [N, T, T] scores: about 64 GiB of temporaries per v5e chip (16 GiB)."""
    from nnx_zoo.planning.cli import Request, build
    from nnx_zoo.planning.search import search

    request = Request(
        topology="v5e:2x4",
        model="tiny",
        strategies="fsdp",
        batch_size=128,
        seq_len=8192,
        remat=["none"],
        micro_batches=["1"],
        attention_impl="xla",
    )
    run, target, candidates, _ = build(request)
    result = search(run, target, candidates, exhaustive=True)
    (plan,) = result.plans
    assert not plan.fits and "HLO temporaries" in plan.compile_error
    assert plan.temp_bytes > 3 * target.chip.memory_bytes  # the compiler's figure, parsed
    assert plan.to_json()["predicted_from"] == "bound"  # no program to forecast from
    assert result.best is None and "use more remat" in result.reason
