"""An attention backend named on the command line is a promise: where it cannot run on this
host, or cannot run one of the calls the model makes, train_main stops with one line on stderr
and exit status 2 while the run is built (before run_info.json or a step); only `auto` chooses,
and run_info.json records what it chose for each call site (this host is a CPU)."""

from __future__ import annotations

import json
import os

import pytest
from _train_helpers import QUIET_LOGS, SMALL_SHAPES, cli_flags, run_train_main

CASES = {
    "splash flag": (["--attention_impl=splash"], "'splash' needs a TPU"),
    "cudnn config field": (["--config.model.attention_impl=cudnn"], "'cudnn' needs an NVIDIA GPU"),
}
# One step of the smallest model; rows of 128 (splash tiles keys by 128).
ONE_STEP = {
    **SMALL_SHAPES,
    "data.seq_len": 128,
    "optimizer.warmup_steps": 0,
    "training.steps": 1,
    "training.eval_every": 0,
    **QUIET_LOGS,
    "checkpoint.enabled": False,
}


@pytest.mark.parametrize("case", list(CASES))
def test_backend_that_cannot_run_here_exits_2_with_one_line(case, tmp_path):
    args, expected = CASES[case]
    result = run_train_main([f"--workdir={tmp_path}", *args])
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr[-2000:]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: attention implementation") and expected in lines[0]
    assert "use 'xla' or 'auto'" in lines[0]


def test_named_backend_that_cannot_express_a_call_exits_2_while_the_run_is_built(tmp_path):
    """splash runs on this CPU (Pallas interpret mode), but not the context-parallel
    all_gather call (each device's T/2 queries against all T keys: T != S, which its index
    masks cannot say). The run stops while it is built, naming the call; it is not trained
    on xla in splash's place."""
    result = run_train_main(
        [
            f"--workdir={tmp_path}",
            "--attention_impl=splash",
            "--sharding_strategy=fsdp_cp",
            "--config.model.attention_interpret=True",
            *cli_flags(ONE_STEP),
        ]
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr[-2000:]
    assert lines == [
        "error: attention implementation 'splash' cannot run a call this model makes (causal "
        "context-parallel all_gather block over context: T=64, S=128, 8/4 heads x 8, float32, "
        "packed rows, no window): it masks by index and needs T == S (query t and key t at one "
        "position), got T=64, S=128; use attention_impl 'auto' (it runs such calls on xla) or "
        "'xla'"
    ], result.stderr
    assert not os.path.exists(tmp_path / "run_info.json")
    assert not os.path.exists(tmp_path / "metrics.jsonl")


@pytest.mark.parametrize(
    "strategy, call",
    [
        ("fsdp_tp", "causal self-attention: T=S=128"),
        ("fsdp_cp", "causal context-parallel all_gather block over context: T=64, S=128"),
    ],
)
def test_auto_records_its_choice_for_each_call_site_in_run_info(strategy, call, tmp_path):
    result = run_train_main(
        [
            f"--workdir={tmp_path}",
            "--attention_impl=auto",
            f"--sharding_strategy={strategy}",
            *cli_flags(ONE_STEP),
        ]
    )
    assert result.returncode == 0, result.stderr[-2000:]
    with open(tmp_path / "run_info.json") as f:
        recorded = json.load(f)["attention"]
    assert recorded == {
        "implementation": "auto",
        "calls": [
            {
                "call": f"{call}, 8/4 heads x 8, float32, packed rows, no window",
                "backend": "xla",
                "why": "auto: no flash backend for cpu",
            }
        ],
    }


def test_eval_main_records_auto_choices_in_eval_json(tmp_path):
    """eval.json records each call site of the evaluation and of the generation (its prefill
    and decode steps over the KV cache) with the backend `auto` ran it on."""
    import _entry

    trained = run_train_main(
        [f"--workdir={tmp_path}", *cli_flags({**ONE_STEP, "checkpoint.enabled": True})]
    )
    assert trained.returncode == 0, trained.stderr[-2000:]
    result = _entry.evaluate(
        [
            f"--workdir={tmp_path}",
            "--attention_impl=auto",
            "--eval_batches=1",
            "--prompt=def",
            "--max_new_tokens=2",
        ]
    )
    assert result.returncode == 0, result.stderr[-2000:]
    with open(tmp_path / "eval.json") as f:
        recorded = json.load(f)["attention"]
    rest = "8/4 heads x 8, float32, packed rows, no window"
    calls = [
        f"causal self-attention: T=S=128, {rest}",
        f"causal attention over a KV cache: T=3, S=5, {rest}",  # the prompt's 3 bytes
        f"causal attention over a KV cache: T=1, S=5, {rest}",
    ]
    why = "auto: no flash backend for cpu"
    assert recorded == {
        "implementation": "auto",
        "calls": [{"call": c, "backend": "xla", "why": why} for c in calls],
    }
