"""The model reaches each flash backend on the real chips' compilers, with no chip here.

The tiny model's train step (the product's Trainer, bf16, fsdp_tp on (4, 2)) is compiled for
8 abstract TPU v5p chips and 8 abstract H100s (planning.targets), and the compiled HLO is
searched for the kernels:

- v5p with `auto`: splash's forward, dq and dkv Pallas kernels (segmented: packed rows).
- H100 with `auto`: a packed training batch compiles to cuDNN fused attention with the
  document mask as a bias (`__cudnn$fmhaScaleBiasSoftmax` and its backward); an unpacked
  eval batch (one document per row) to the length-masked one (`__cudnn$fmhaSoftmax`); with
  `xla`, no cuDNN call at all.

These need the [tpu] / [gpu] extras and fail (never skip) without them.
"""

from __future__ import annotations

import re

import jax
import pytest

from nnx_zoo.launch.build import abstract_run
from nnx_zoo.planning import target_devices
from shardings import get_strategy
from zoo import get_config

B, T = 8, 128
STRATEGY = get_strategy("fsdp_tp")


def _compile(target, attention_impl, *, train=True, packed=True):
    cfg = get_config("tiny", dtype="bfloat16", attention_impl=attention_impl)
    mesh = STRATEGY.make_mesh(shape=(4, 2), devices=target_devices(target), config=cfg)
    run = abstract_run(cfg, STRATEGY.name, mesh, batch_size=B, seq_len=T, packed=packed)
    with jax.set_mesh(mesh):
        return run.trainer.lower(run.abstract_batch(), train=train).compile().as_text()


def _custom_calls(hlo: str) -> set[str]:
    return set(re.findall(r'custom_call_target="([^"]+)"', hlo))


@pytest.mark.tpu_compile
def test_v5p_auto_train_step_runs_splash_forward_and_backward():
    hlo = _compile("v5p:2x2x2", "auto")
    kernels = set(re.findall(r"%(splash_mha_\w+?)(?:\.\d+)? = ", hlo))
    assert any(k.startswith("splash_mha_fwd_segmented") for k in kernels), kernels
    assert any(k.startswith("splash_mha_dq_segmented") for k in kernels), kernels
    assert any(k.startswith("splash_mha_dkv_segmented") for k in kernels), kernels
    assert "tpu_custom_call" in _custom_calls(hlo)


@pytest.mark.gpu_compile
def test_h100_auto_packed_train_step_runs_cudnn_with_the_document_mask():
    calls = _custom_calls(_compile("h100:8", "auto"))
    assert "__cudnn$fmhaScaleBiasSoftmax" in calls, calls
    assert "__cudnn$fmhaScaleBiasSoftmaxBackward" in calls, calls


@pytest.mark.gpu_compile
def test_h100_auto_unpacked_eval_step_runs_cudnn_by_sequence_lengths():
    calls = _custom_calls(_compile("h100:8", "auto", train=False, packed=False))
    assert "__cudnn$fmhaSoftmax" in calls, calls
    assert not any("Bias" in c for c in calls), calls  # no mask tensor for unpacked rows


@pytest.mark.gpu_compile
def test_h100_xla_train_step_has_no_cudnn_attention():
    calls = _custom_calls(_compile("h100:8", "xla"))
    assert not any(c.startswith("__cudnn$fmha") for c in calls), calls
