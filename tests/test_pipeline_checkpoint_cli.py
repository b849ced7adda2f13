"""A pipeline strategy stores the global arrays every other strategy stores: a checkpoint
saved under fsdp_pp restores under fsdp bit for bit, and one saved under fsdp restores under
fsdp_pp; bad pipeline inputs end train_main / eval_main with exit status 2 and one line.

Through the entry points (issue 28, check 2 and the run itself): train_main under fsdp_pp
stopped at step 2 and started again resumes and finishes with fsdp's losses (float32: the
pipeline only reorders which rows run when; 1e-5 relative, as the equality tests' Adam steps,
where the runs agree to ~1e-7), and eval_main evaluates its checkpoint under dp to the run's
own last validation loss.
"""

from __future__ import annotations

import _entry
import numpy as np
import pytest
from _train_helpers import (
    SMALL_RUN,
    assert_evaluates_under_dp,
    cli_flags,
    run_train_main,
    train_losses,
)
from flax import nnx
from test_checkpoint import build, data_iter, leaves, restored_equal, take_optimizer_step

from nnx_zoo.checkpoint.manager import Checkpointer

PIPE = ("fsdp_pp", (2, 4))
FLAT = ("fsdp", (8,))


def _save(workdir, strategy_shape):
    mesh, model, optimizer = build(*strategy_shape)
    take_optimizer_step(mesh, model, optimizer)
    ckpt = Checkpointer(workdir, save_every=1, keep=1, run_info={"strategy": strategy_shape[0]})
    assert ckpt.save(3, model=model, optimizer=optimizer, data_iter=data_iter(), meta={})
    ckpt.close()
    return leaves(model), leaves(optimizer, nnx.optimizer.OptState)


@pytest.mark.parametrize(
    "source, target", [(PIPE, FLAT), (FLAT, PIPE)], ids=["pp-to-fsdp", "fsdp-to-pp"]
)
def test_checkpoint_moves_between_pipeline_and_fsdp_bit_for_bit(tmp_path, source, target):
    params, opt_state = _save(str(tmp_path), source)
    model = restored_equal(str(tmp_path), 3, target, params, opt_state)
    # The restored stacked weights carry the target's layout: L over `stage` under fsdp_pp.
    q = nnx.state(model, nnx.Param)["blocks"]["attention"]["q"]["weight"][...]
    assert (tuple(q.sharding.spec)[0] == "stage") == (target is PIPE)


def _one_line_error(proc):
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1, proc.stderr[-2000:]
    return lines[0]


PIPE_FLAGS = ["--sharding_strategy=fsdp_pp", "--mesh_shape=stage:2,data:4"]


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            {"model.num_layers": 2, "model.pipeline_repeats": 2},
            "does not divide by stages x repeats",
        ),
        ({"model.pipeline_microbatches": 1}, "fewer than the 2 pipeline stages"),
        ({"data.global_batch_size": 8, "model.pipeline_microbatches": 4}, "micro-batches"),
    ],
    ids=["layers", "microbatches", "batch"],
)
def test_bad_pipeline_input_is_one_line(tmp_path, overrides, expected):
    args = [*cli_flags({**SMALL_RUN, **overrides}), *PIPE_FLAGS, f"--workdir={tmp_path}"]
    assert expected in _one_line_error(run_train_main(args))


def test_prompt_under_pipeline_is_one_line(tmp_path):
    # The strategy is checked before the checkpoint is read: no run is needed.
    proc = _entry.evaluate([f"--workdir={tmp_path}", "--sharding_strategy=fsdp_pp", "--prompt=hi"])
    assert "pipeline strategy fsdp_pp" in _one_line_error(proc)


STEPS = 4
RUN = {
    **SMALL_RUN,
    "training.steps": STEPS,
    "optimizer.decay_steps": STEPS,  # the schedule may not depend on where a run stops
    "training.eval_every": STEPS,
    "checkpoint.enabled": True,
    "checkpoint.every": 2,
}


def _train(workdir, strategy_flags, **overrides):
    args = [f"--workdir={workdir}", *strategy_flags, *cli_flags({**RUN, **overrides})]
    proc = run_train_main(args)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_train_resume_eval_under_dp(tmp_path):
    piped = str(tmp_path / "fsdp_pp")
    _train(piped, PIPE_FLAGS, **{"training.steps": 2})
    _train(piped, PIPE_FLAGS)  # resumes from the step-2 checkpoint
    flat = str(tmp_path / "fsdp")
    _train(flat, ["--sharding_strategy=fsdp", "--mesh_shape=data:8"])
    losses = train_losses(piped)
    assert len(losses) == STEPS
    np.testing.assert_allclose(losses, train_losses(flat), rtol=1e-5)

    assert_evaluates_under_dp(piped, STEPS)
