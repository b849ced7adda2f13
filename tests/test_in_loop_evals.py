"""lm-eval tasks inside training (config `eval`) and the Weights & Biases writer
(`logging.wandb_*`), on one small run trained by train_main in this process with an HF
tokenizer (bench/fixtures.py's llama-style BPE), under fsdp_tp on 8 devices:

- the scores the run logs at step 2 equal `eval_main --tasks` on the step-2 checkpoint;
- the time those evals take is not in the next logged line's step time;
- the offline W&B run holds metrics.jsonl's losses and the scores, with the run's config and
  run_info as its config; the run resumed in the same workdir logs to the same W&B run id;
- without the wandb package, `logging.wandb_project` exits 2 naming the install command.
"""

from __future__ import annotations

import json
import math
import os
import sys

import _entry
import pytest
from _train_helpers import SMALL_RUN, cli_flags, run_train_main
from _wandb_records import offline_runs, read_run

from bench.fixtures import TASKS, write_tokenizer
from nnx_zoo.training.metrics import read_metrics

pytest.importorskip("lm_eval", reason="the [eval] extra (lm-eval) is not installed")
pytest.importorskip("wandb", reason="the [wandb] extra is not installed")

TASK_FLAGS = ["--tasks=zoo_facts,zoo_prose", f"--include_path={TASKS}", "--limit=4"]


def _flags(workdir, tokenizer, steps, **extra):
    overrides = {
        **SMALL_RUN,
        "data.tokenizer": tokenizer,
        "optimizer.warmup_steps": 1,
        "training.steps": steps,
        "training.eval_every": 0,
        "logging.log_every": 4,
        "checkpoint.enabled": True,
        "checkpoint.every": 2,
        "logging.wandb_project": "zoo-test",
        "logging.wandb_tags": "ci,tiny",
        **extra,
    }
    return ["--sharding_strategy=fsdp_tp", f"--workdir={workdir}", *cli_flags(overrides)]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(workdir, W&B dir): 4 steps, the tasks at step 2 and at the end, then 2 more steps in
    the same workdir (resumed from step 4, no tasks)."""
    tokenizer = str(tmp_path_factory.mktemp("tokenizer"))
    write_tokenizer(tokenizer, "llama")
    workdir = str(tmp_path_factory.mktemp("run"))
    wandb_dir = str(tmp_path_factory.mktemp("wandb"))
    with pytest.MonkeyPatch.context() as env:
        env.setenv("WANDB_MODE", "offline")
        env.setenv("WANDB_DIR", wandb_dir)
        env.setenv("WANDB_SILENT", "true")
        tasks = {"eval.tasks": "zoo_facts,zoo_prose", "eval.every": 2, "eval.limit": 4}
        tasks["eval.include_path"] = TASKS
        first = run_train_main(_flags(workdir, tokenizer, 4, **tasks))
        assert first.returncode == 0, first.stderr[-3000:]
        first_lines = read_metrics(os.path.join(workdir, "metrics.jsonl"))
        second = run_train_main(_flags(workdir, tokenizer, 6))
        assert second.returncode == 0, second.stderr[-3000:]
    return workdir, wandb_dir, first_lines


def _scores(lines, step):
    (line,) = [r for r in lines if r["step"] == step and "lm_eval/eval_time" in r]
    return line


def test_in_loop_scores_equal_eval_main_on_the_checkpoint_of_the_same_step(run):
    workdir, _, lines = run
    proc = _entry.run_main("eval_main", [f"--workdir={workdir}", "--step=2", *TASK_FLAGS])
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(os.path.join(workdir, "lm_eval.json")) as f:
        reference = json.load(f)["results"]
    logged = _scores(lines, 2)
    expected = {}
    for task, metrics in reference.items():
        for key, value in metrics.items():
            if isinstance(value, float) and not key.startswith("sample_len"):
                expected[f"lm_eval/{task}/{key.split(',')[0]}"] = value
    assert set(expected) == set(logged) - {"step", "lm_eval/eval_time"}
    assert {"lm_eval/zoo_facts/acc", "lm_eval/zoo_prose/bits_per_byte"} <= set(expected)
    # The same parameters, mesh, rows and harness call: the same numbers, to the last bit
    # (the programs are compiled apart, so float noise would be allowed; none is seen).
    assert logged == {"step": 2, "lm_eval/eval_time": logged["lm_eval/eval_time"], **expected}
    # And a model that trained between the two evaluations scores differently at the end.
    end = _scores(lines, 4)
    assert end["lm_eval/zoo_prose/bits_per_byte"] != logged["lm_eval/zoo_prose/bits_per_byte"]


def test_eval_time_is_left_out_of_the_step_timings(run):
    _, _, lines = run
    eval_time = _scores(lines, 2)["lm_eval/eval_time"]
    (line,) = [r for r in lines if r["step"] == 4 and "loss" in r]
    # Step 4's line covers steps 2-4; the tasks ran after step 2. Counted in, they would make
    # each of the 3 steps at least eval_time / 3 long (the tasks take seconds; a step, ms).
    assert line["step_time"] < eval_time / 3, (line["step_time"], eval_time)
    assert line["tokens_per_second"] > 3 * 16 * 64 / eval_time


def test_wandb_history_holds_the_losses_of_metrics_jsonl(run):
    workdir, wandb_dir, _ = run
    files = offline_runs(wandb_dir)
    assert len(files) == 2, files  # the first run and the resumed one
    first = read_run(files[0])
    with open(os.path.join(workdir, "wandb_run.json")) as f:
        assert json.load(f)["id"] == first["id"]
    assert (first["project"], first["tags"]) == ("zoo-test", ["ci", "tiny"])
    assert first["name"] == os.path.basename(workdir)
    # The run's config and run_info, memory included (W&B starts after the compile).
    config = first["config"]
    assert config["config"]["eval"]["tasks"] == "zoo_facts,zoo_prose"
    assert config["strategy"] == "fsdp_tp" and config["mesh_shape"] == {"data": 4, "model": 2}
    assert config["memory"]["peak_bytes"] > 0
    lines = read_metrics(os.path.join(workdir, "metrics.jsonl"))
    losses = {r["step"]: r["loss"] for r in lines if "loss" in r}
    assert sorted(losses) == [1, 4, 5, 6]
    history = first["history"]
    assert {s: h["train/loss"] for s, h in history.items() if "train/loss" in h} == {
        s: losses[s] for s in (1, 4)
    }
    vals = {r["step"]: r["val_loss"] for r in lines if "val_loss" in r}
    assert history[4]["eval/loss"] == vals[4]
    for step in (2, 4):
        scores = _scores(lines, step)
        assert {k: history[step][k] for k in scores if k != "step"} == {
            k: v for k, v in scores.items() if k != "step"
        }


def test_a_resumed_run_logs_to_the_same_wandb_run(run):
    workdir, wandb_dir, _ = run
    first, second = (read_run(p) for p in offline_runs(wandb_dir))
    assert second["id"] == first["id"]
    lines = read_metrics(os.path.join(workdir, "metrics.jsonl"))
    losses = {r["step"]: r["loss"] for r in lines if "loss" in r}
    # Steps 5 and 6 only: `wandb sync` of both files appends them to the one W&B run.
    logged = {s: h["train/loss"] for s, h in second["history"].items() if "train/loss" in h}
    assert logged == {5: losses[5], 6: losses[6]}
    assert all(math.isfinite(v) for v in logged.values())


def test_wandb_project_without_the_package_exits_2_naming_the_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    proc = run_train_main(
        [f"--workdir={tmp_path}", *cli_flags({**SMALL_RUN, "logging.wandb_project": "p"})]
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        'error: config logging.wandb_project needs the wandb package: pip install "nnx-zoo[wandb]"'
    )
    assert set(os.listdir(tmp_path)) <= {".lock"}  # nothing written


@pytest.mark.parametrize(
    "overrides,line",
    [
        (
            {"eval.tasks": "no_such_task_zz"},
            "error: config eval.tasks='no_such_task_zz': unknown task 'no_such_task_zz': not in "
            "eval.include_path=",
        ),
        ({"eval.every": 5}, "error: config eval.every=5: needs eval.tasks (the tasks to run)"),
        (
            {"eval.tasks": "zoo_facts", "eval.limit": 0.0},
            "error: config eval.limit=0.0: must be > 0",
        ),
        (
            {"logging.wandb_tags": "a"},
            "error: config logging.wandb_tags='a': needs logging.wandb_project",
        ),
    ],
)
def test_bad_eval_and_wandb_settings_exit_2_with_one_line(tmp_path, overrides, line):
    proc = run_train_main([f"--workdir={tmp_path}", *cli_flags({**SMALL_RUN, **overrides})])
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(line), proc.stderr[-2000:]
