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
        assert record["moe_dropped"] == 0.0  # dropless (CPU's padded exchange, factor 0)
        # The spread is the worst layer's busiest share x E; the logged shares are the mean
        # of the L = 2 layers', so an expert's share in one layer is at least its mean share
        # (for the busiest one) and at most L x it: the spread lies between E x and L x E x
        # the busiest logged share (5-decimal rounding of the shares aside). A spread taken
        # from anything else than this step's router load falls outside.
        spread, busiest = record["moe_load_spread"], max(load)
        assert 8 * busiest - 1e-3 <= spread <= 2 * 8 * busiest + 1e-3, (spread, load)
    # A live metric: the router's balance moves as it trains (a constant, such as perfect
    # balance at 1, would pass the bounds above for a constant load).
    assert len({round(r["moe_load_spread"], 4) for r in records}) > 1, records
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
    # The shard spread follows the plan's mesh: one expert per shard on expert:8, the busiest
    # expert's mean share x 8 (where 2 experts per shard above averaged the busiest with its
    # neighbour).
    single = _plan(mesh_shape="data:1,expert:8", moe_load_from=workdir)
    assert single["load_spread_shard"] == pytest.approx(share.max() * 8 / share.sum(), abs=1e-4)
    assert single["load_spread_expert"] == plan["load_spread_expert"]


def test_moe_load_from_refuses_what_it_cannot_use(tmp_path, moe_run):
    with pytest.raises(ValueError, match="cannot read metrics.jsonl"):
        _plan(moe_load_from=str(tmp_path / "nowhere"))
    dense = {"model": {"preset": "tiny"}, "data": {"seq_len": 64, "global_batch_size": 8}}
    with pytest.raises(ValueError, match="has no experts"):
        planner.plan(
            planner.Request(topology="cpu:8", config=dense, moe_load_from=moe_run[0]),
            as_json=True,
        )
