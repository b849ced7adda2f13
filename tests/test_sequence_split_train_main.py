"""Sequence parallelism (fsdp_tp_sp) and both context_parallel methods (all_gather, ring) of
fsdp_cp / fsdp_tp_cp, through the entry points, in-process (issue 41, check 1):

- train_main trains the small run 3 steps under each with dp's losses: dp runs the one-device
  computation on each device's rows, and the others only split it further, so in float32 the
  losses agree to reduction-order rounding (1e-5 relative, as the pipeline's CLI test);
- eval_main evaluates each run's checkpoint under dp to the run's own last validation loss;
- a checkpoint saved under fsdp_tp_sp restores under fsdp_tp bit for bit and back (they
  declare the same weight layouts; only activations differ).
"""

from __future__ import annotations

import os

import _entry
import numpy as np
import pytest
from _train_helpers import SMALL_RUN, assert_evaluates_under_dp, cli_flags, train_losses
from flax import nnx
from test_checkpoint import build, data_iter, leaves, restored_equal, take_optimizer_step

from nnx_zoo.checkpoint.manager import Checkpointer

STEPS = 3
RUN = {
    **SMALL_RUN,
    "training.steps": STEPS,
    "optimizer.decay_steps": STEPS,
    "training.eval_every": STEPS,
    "training.eval_batches": 1,
    "checkpoint.enabled": True,
    "checkpoint.every": STEPS,
}
RING = "--config.model.context_parallel=ring"
CASES = {
    "fsdp_tp_sp": ["--sharding_strategy=fsdp_tp_sp", "--mesh_shape=data:4,model:2"],
    "fsdp_cp-all_gather": ["--sharding_strategy=fsdp_cp", "--mesh_shape=data:2,context:4"],
    "fsdp_cp-ring": ["--sharding_strategy=fsdp_cp", "--mesh_shape=data:2,context:4", RING],
    "fsdp_tp_cp-all_gather": [
        "--sharding_strategy=fsdp_tp_cp",
        "--mesh_shape=data:2,context:2,model:2",
    ],
    "fsdp_tp_cp-ring": [
        "--sharding_strategy=fsdp_tp_cp",
        "--mesh_shape=data:2,context:2,model:2",
        RING,
    ],
}


def _train(workdir, strategy_flags):
    result = _entry.train([f"--workdir={workdir}", *strategy_flags, *cli_flags(RUN)])
    assert result.returncode == 0, result.stderr[-3000:]
    return train_losses(workdir)


@pytest.fixture(scope="module")
def dp_losses(tmp_path_factory):
    return _train(str(tmp_path_factory.mktemp("dp")), ["--sharding_strategy=dp"])


@pytest.mark.parametrize("case", list(CASES))
def test_trains_with_dp_losses_and_evaluates_under_dp(tmp_path, dp_losses, case):
    workdir = str(tmp_path)
    losses = _train(workdir, CASES[case])
    assert len(losses) == STEPS
    np.testing.assert_allclose(losses, dp_losses, rtol=1e-5)

    assert_evaluates_under_dp(workdir, STEPS)


SP, TP = ("fsdp_tp_sp", (4, 2)), ("fsdp_tp", (4, 2))


@pytest.mark.parametrize("source, target", [(SP, TP), (TP, SP)], ids=["sp-to-tp", "tp-to-sp"])
def test_checkpoint_moves_between_fsdp_tp_sp_and_fsdp_tp_bit_for_bit(tmp_path, source, target):
    mesh, model, optimizer = build(*source)
    take_optimizer_step(mesh, model, optimizer)
    ckpt = Checkpointer(str(tmp_path), save_every=1, keep=1, run_info={"strategy": source[0]})
    assert ckpt.save(3, model=model, optimizer=optimizer, data_iter=data_iter(), meta={})
    ckpt.close()
    params, opt_state = leaves(model), leaves(optimizer, nnx.optimizer.OptState)

    restored_equal(str(tmp_path), 3, target, params, opt_state)


BAD_INPUTS = {
    "unknown context_parallel": (
        ["--sharding_strategy=fsdp_cp", "--config.model.context_parallel=rings"],
        "config model.context_parallel='rings': valid: all_gather, ring",
    ),
    "T not splitting over the residual's model axis": (
        [
            "--sharding_strategy=fsdp_tp_sp",
            "--mesh_shape=data:2,model:4",
            "--config.data.seq_len=66",
        ],
        "sequence length 66 is split over mesh axis model=4 in the residual stream",
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_exit_2_and_one_line(tmp_path, case):
    flags, expected = BAD_INPUTS[case]
    # After the small run's flags, so that these override them.
    result = _entry.train([f"--workdir={tmp_path}", *cli_flags(SMALL_RUN), *flags])
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-2000:]
    assert expected in lines[0], lines[0]
    assert not os.path.exists(tmp_path / "metrics.jsonl")


def test_generation_under_sequence_parallelism_is_one_line(tmp_path):
    result = _entry.evaluate(
        [f"--workdir={tmp_path}", "--sharding_strategy=fsdp_tp_sp", "--prompt=hi"]
    )
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-2000:]
    assert "sequence-parallel strategy fsdp_tp_sp" in lines[0], lines[0]
