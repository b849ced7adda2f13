"""train_main.py trains the tiny Qwen3-MoE under fsdp_ep: the loss falls, and metrics.jsonl
carries the load-balancing loss, the router's load per expert, its spread and the share of
assignments dropped."""

from __future__ import annotations

import json
import os

import numpy as np
from _train_helpers import SMALL_RUN, cli_flags, run_train_main, train_losses


def test_qwen3_moe_trains_under_fsdp_ep(tmp_path):
    workdir = str(tmp_path / "moe")
    steps = 25
    overrides = {
        **SMALL_RUN,
        "model.preset": "qwen3-moe-tiny",
        "training.steps": steps,
        "training.eval_every": 0,
        "data.global_batch_size": 8,
    }
    result = run_train_main(
        ["--sharding_strategy=fsdp_ep", f"--workdir={workdir}", *cli_flags(overrides)],
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # The default rule for 8 devices and 8 experts: every device on `expert`.
    assert "fsdp_ep on mesh {'data': 1, 'expert': 8}" in result.stderr + result.stdout

    losses = train_losses(workdir)
    assert len(losses) == steps
    # Untrained ~ln(512) = 6.24 plus 0.01 x aux (~2); byte-level source drops well below it in
    # 25 steps at this rate (measured ~3.5); 1.5 nats is far outside step noise.
    assert losses[0] > 5.5 and np.mean(losses[-5:]) < losses[0] - 1.5

    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if '"loss"' in line]
    for record in records:
        load = record["expert_load"]
        assert len(load) == 8 and abs(sum(load) - 1.0) < 1e-3, load  # shares of assignments
        # E * sum(f * p) >= 1 when f and p agree; a broken router would give 0 or NaN.
        assert 0.5 < record["aux_loss"] < 8.0, record["aux_loss"]
        # Dropless (CPU's padded exchange at capacity factor 0); the busiest expert's share
        # over the mean is at least 1 and at most E.
        assert record["moe_dropped"] == 0.0
        assert 1.0 <= record["moe_load_spread"] <= 8.0, record["moe_load_spread"]
    with open(os.path.join(workdir, "run_info.json")) as f:
        assert json.load(f)["strategy"] == "fsdp_ep"
