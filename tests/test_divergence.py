"""A run whose loss stops being finite ends with exit status 1 and one line, and never saves
a state with NaN in it, also at a save between two log steps."""

import json
import os

from _train_helpers import SMALL_RUN, cli_flags, run_train_main

from nnx_zoo.checkpoint.steps import checkpoint_dir, complete_steps

# A learning rate of 1e30 moves every parameter by ~1e30 in the first update (Adam's step is
# ~lr per element whatever the gradient's scale): step 1's loss is the untrained one, step 2's
# overflows float32 in the first norm. Saves every step, logs only at step 1 (the first step
# is always logged) and step 10: step 2's save is what must notice.
RUN = {
    **SMALL_RUN,
    "model.num_layers": 1,
    "optimizer.learning_rate": 1e30,
    "optimizer.warmup_steps": 0,
    "training.steps": 4,
    "training.eval_every": 0,
    "logging.log_every": 10,
    "checkpoint.enabled": True,
    "checkpoint.every": 1,
}


def test_divergence_exits_1_in_one_line_and_saves_no_nan(tmp_path):
    workdir = str(tmp_path / "run")
    flags = ["--sharding_strategy=dp", f"--workdir={workdir}", *cli_flags(RUN)]
    result = run_train_main(flags, num_devices=1)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith("error: training diverged: loss is nan at step 2; "), lines[0]
    assert "the last save is step 1" in lines[0], lines[0]

    # Only the finite state was saved; the metrics file is whole JSON lines.
    assert complete_steps(checkpoint_dir(workdir)) == [1]
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records if "loss" in r] == [1]


def test_non_finite_val_loss_exits_1_before_the_save(tmp_path):
    # The same 1e30 step: step 1's training loss is the untrained one (finite), but the
    # validation after it runs on the moved parameters and overflows. Before the guard looked
    # at val_loss, step 1 was saved and the run went on to fail a step later.
    workdir = str(tmp_path / "run")
    run = {**RUN, "training.steps": 2, "training.eval_every": 1, "training.eval_batches": 1}
    flags = ["--sharding_strategy=dp", f"--workdir={workdir}", *cli_flags(run)]
    result = run_train_main(flags, num_devices=1)
    assert result.returncode == 1, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith("error: training diverged: val_loss is nan at step 1; "), lines[0]
    assert "nothing was saved" in lines[0], lines[0]
    assert complete_steps(checkpoint_dir(workdir)) == []
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    assert records[0]["step"] == 1 and records[0]["loss"] > 0
    # NaN over counted tokens (JSON null): a diverged model, not a split with no tokens.
    assert records[1]["val_loss"] is None and records[1]["val_tokens"] > 0
