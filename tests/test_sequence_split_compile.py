"""What sequence parallelism and ring attention compile to on the real chips' compilers, with
no chip here (issue 41, check 2): the tiny model's train step (the product's Trainer, bf16,
packed rows, batch 8 x 128), compiled for 8 abstract H100s and 8 abstract TPU v5p chips
(planning.targets), its collectives read from the partitioned HLO (shardings.hlo).

- fsdp_tp_sp on h100:8 (data:4, model:2): inside the layer loop every collective over `model`
  is an all-gather (each norm's output, T gathered into attention / the MLP) or a
  reduce-scatter (o / down back into the T-split residual), on the [B/data, T, M] activation,
  and none is an all-reduce; fsdp_tp's M-split residual needs all-reduces over `model` there
  (each norm's statistics over the split M).
- fsdp_cp with context_parallel=ring on v5p:2x2x2 and h100:8 (data:2, context:4):
  collective-permutes over `context` inside the layer loop, and no float all-gather over
  `context` there (all_gather's K/V gather). On v5p (`auto`, rows of 1024: blocks of 256 local
  tokens, half blocks of 128 as the kernel tiles) each block runs splash's forward (with its
  log-sum-exp), dq and dkv kernels; on h100 the blocks are XLA's (cuDNN has no ring form).

These need the [tpu] / [gpu] extras and fail (never skip) without them.
"""

from __future__ import annotations

import re

import jax
import pytest

from nnx_zoo.launch.build import abstract_run
from nnx_zoo.planning import target_devices
from shardings import get_strategy
from shardings.hlo import collectives
from zoo import get_config

B, T = 8, 128
LAYERS = get_config("tiny").num_layers
FLOATS = {"f32", "bf16"}


def _compile(target, strategy_name, shape, batch=B, seq_len=T, **model):
    cfg = get_config("tiny", dtype="bfloat16", **model)
    strategy = get_strategy(strategy_name)
    mesh = strategy.make_mesh(shape=shape, devices=target_devices(target), config=cfg)
    run = abstract_run(cfg, strategy_name, mesh, batch_size=batch, seq_len=seq_len, packed=True)
    with jax.set_mesh(mesh):
        hlo = run.trainer.lower(run.abstract_batch()).compile().as_text()
    return hlo, collectives(hlo, dict(mesh.shape)), cfg


def _collectives(target, strategy_name, shape, **model):
    _, ops, cfg = _compile(target, strategy_name, shape, **model)
    return ops, cfg


def _in_layer_loop(ops, axis):
    # The scanned layer stack is a while loop run L times; an op inside runs L times a step
    # (or a multiple, inside a loop of its own: the ring's steps).
    return [o for o in ops if o.axes == (axis,) and o.executions >= LAYERS]


@pytest.mark.gpu_compile
def test_sequence_parallel_gathers_and_reduce_scatters_where_fsdp_tp_all_reduces():
    ops, cfg = _collectives("h100:8", "fsdp_tp_sp", (4, 2))
    layer = _in_layer_loop(ops, "model")
    activation_bytes = (B // 4) * T * cfg.hidden_dim * 2  # [B/data, T, M] bf16, whole
    kinds = {(o.op, o.array_bytes) for o in layer}
    assert kinds == {
        ("all-gather", activation_bytes),
        ("reduce-scatter", activation_bytes),
    }, kinds
    gathers = sum(o.op == "all-gather" for o in layer)
    scatters = sum(o.op == "reduce-scatter" for o in layer)
    # Forward: one pair per sub-block (attention, MLP); the backward mirrors them.
    assert gathers >= 4 and scatters >= 4, (gathers, scatters)

    fsdp_tp, _ = _collectives("h100:8", "fsdp_tp", (4, 2))
    assert any(o.op == "all-reduce" for o in _in_layer_loop(fsdp_tp, "model"))


@pytest.mark.parametrize(
    "target, seq_len",
    [
        pytest.param("v5p:2x2x2", 1024, marks=pytest.mark.tpu_compile),
        pytest.param("h100:8", T, marks=pytest.mark.gpu_compile),
    ],
)
def test_ring_attention_permutes_over_context_and_gathers_no_kv(target, seq_len):
    hlo, ops, _ = _compile(
        target,
        "fsdp_cp",
        (2, 4),
        batch=2,
        seq_len=seq_len,
        context_parallel="ring",
        attention_impl="auto",
    )
    splash = set(re.findall(r"%(splash_mha_\w+?)(?:\.\d+)? = ", hlo))
    if target.startswith("v5p"):
        for kernel in ("fwd_segmented_residuals", "dq_segmented", "dkv_segmented"):
            assert any(k.startswith(f"splash_mha_{kernel}") for k in splash), splash
    else:
        assert not splash and "__cudnn$fmha" not in hlo
    permutes = [o for o in _in_layer_loop(ops, "context") if o.op == "collective-permute"]
    # K, V (and their ids, positions) 3 hops forward; backward 3 more and dK, dV 4.
    assert len(permutes) >= 6, permutes
    # K/V would be gathered per layer, inside the loop (all_gather's form).
    kv_gathers = [
        o for o in _in_layer_loop(ops, "context") if o.op == "all-gather" and FLOATS & set(o.dtypes)
    ]
    assert not kv_gathers, kv_gathers
