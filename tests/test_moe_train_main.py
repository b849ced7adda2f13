"""train_main.py trains the tiny Qwen3-MoE under fsdp_ep: the loss falls, and metrics.jsonl
carries the load-balancing loss, the router's load per expert, its spread and the share of
assignments dropped. plan_main's `--moe_load_from` reads that run's load back into a plan."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from _train_helpers import SMALL_RUN, cli_flags, run_train_main, train_losses

from nnx_zoo.planning import cli as planner

STEPS = 25
OVERRIDES = {
    **SMALL_RUN,
    "model.preset": "qwen3-moe-tiny",
    "training.steps": STEPS,
    "training.eval_every": 0,
    "data.global_batch_size": 8,
}


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("moe"))
    result = run_train_main(
        ["--sharding_strategy=fsdp_ep", f"--workdir={workdir}", *cli_flags(OVERRIDES)]
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return workdir, result


def _records(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if '"loss"' in line]


def test_qwen3_moe_trains_under_fsdp_ep(moe_run):
    workdir, result = moe_run
    steps = STEPS
    # The default rule for 8 devices and 8 experts: every device on `expert`.
    assert "fsdp_ep on mesh {'data': 1, 'expert': 8}" in result.stderr + result.stdout

    losses = train_losses(workdir)
    assert len(losses) == steps
    # Untrained ~ln(512) = 6.24 plus 0.01 x aux (~2); byte-level source drops well below it in
    # 25 steps at this rate (measured ~3.5); 1.5 nats is far outside step noise.
    assert losses[0] > 5.5 and np.mean(losses[-5:]) < losses[0] - 1.5

    records = _records(workdir)
    for record in records:
        load = record["expert_load"]
        assert len(load) == 8 and abs(sum(load) - 1.0) < 1e-3, load  # shares of assignments
        # E * sum(f * p) >= 1 when f and p agree; a broken router would give 0 or NaN.
        assert 0.5 < record["aux_loss"] < 8.0, record["aux_loss"]
        # Dropless (CPU's padded exchange at capacity factor 0). The busiest expert's share over
        # the mean lies in [1, E]; its ends mean a metric stuck at perfect balance (1) or a
        # router sending every token to one expert (E = 8), neither of which a live router
        # on 512 tokens a step gives.
        assert record["moe_dropped"] == 0.0
        assert 1.0 < record["moe_load_spread"] < 8.0, record["moe_load_spread"]
        # The spread is the worst layer's busiest share x E; the shares are the layers' mean,
        # so their busiest x E cannot exceed it (5-decimal rounding of the shares aside).
        assert record["moe_load_spread"] >= 8 * max(load) - 1e-3, (record, load)
    with open(os.path.join(workdir, "run_info.json")) as f:
        assert json.load(f)["strategy"] == "fsdp_ep"


def _plan(**request):
    config = {
        "model": {"preset": "qwen3-moe-tiny", "dtype": "float32", "remat": "none"},
        "data": {"seq_len": 64, "global_batch_size": 8},
    }
    base = dict(topology="cpu:8", config=config, strategies="fsdp_ep", as_json=True)
    text = planner.plan(
        planner.Request(**{k: v for k, v in base.items() if k != "as_json"} | request), as_json=True
    )
    return json.loads(text.splitlines()[0])


def test_plan_reports_the_router_load_the_run_measured(moe_run):
    """The plan's spreads are the run's last 10 logged steps: the busiest expert's (worst
    layer) as logged, and the busiest expert shard's from the per-expert shares, for the
    plan's own expert axis (4 shards of 2 experts here)."""
    workdir, _ = moe_run
    last = _records(workdir)[-10:]
    share = np.mean([r["expert_load"] for r in last], axis=0)
    shards = share.reshape(4, 2).sum(axis=1)
    plan = _plan(mesh_shape="data:2,expert:4", moe_load_from=workdir)
    assert plan["load_steps"] == 10
    assert plan["load_spread_expert"] == pytest.approx(
        np.mean([r["moe_load_spread"] for r in last]), abs=1e-4
    )
    assert plan["load_spread_shard"] == pytest.approx(shards.max() * 4 / shards.sum(), abs=1e-4)
    assert 1.0 <= plan["load_spread_shard"] <= plan["load_spread_expert"] + 1e-4


def test_moe_load_from_refuses_what_it_cannot_use(tmp_path, moe_run):
    with pytest.raises(ValueError, match="cannot read metrics.jsonl"):
        _plan(moe_load_from=str(tmp_path / "nowhere"))
    dense = {"model": {"preset": "tiny"}, "data": {"seq_len": 64, "global_batch_size": 8}}
    with pytest.raises(ValueError, match="has no experts"):
        planner.plan(
            planner.Request(topology="cpu:8", config=dense, moe_load_from=moe_run[0]),
            as_json=True,
        )
