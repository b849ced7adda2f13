"""Memory and communication budgets: a few train steps compiled for real TPU and GPU targets,
each held to committed figures (tests/golden/plan_budgets.json), so a change that moves a
plan's temporaries or its collective bytes shows in its diff, as a layout change shows in the
golden layouts. Rewrite them on purpose, under each supported jax, and review the diff:

    NNX_ZOO_WRITE_BUDGETS=1 python -m pytest -q -p no:randomly tests/test_plan_budgets.py

A budget is per jax minor version: the floor and the newest leg compile with different
libtpu / XLA releases, whose temporaries differ by design. The model is Llama-shaped with its
LM head dominating as llama3_8b's does (V/M = 128 here, 31 in 8B; L = 2), at one row per chip
and two loss chunks per row, so the head's gradient is summed over chunks and over devices as
in the 8B FSDP plan of issue 53 (whose regression, a float32 [M, V] all-reduced whole, this
file would have caught), at a compile of seconds.
"""

from __future__ import annotations

import json
import os

import jax
import pytest

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden", "plan_budgets.json")
WRITE = os.environ.get("NNX_ZOO_WRITE_BUDGETS") == "1"
# Relative: compiles of one version are deterministic; this absorbs a patch release's drift,
# and nothing that a layout or a collective change moves (issue 53's regression was +33% of
# temp bytes and an all-reduce kind 2000x its budget).
TOLERANCE = 0.03
# A collective kind below this many bytes per step is noise-level (scalars: the loss, the
# gradient norm); its growth past the floor still fails.
FLOOR_BYTES = 1 << 20

# name -> (strategy, target topology, mesh shape or None for the strategy's default)
PLANS = {
    "fsdp@v5p:2x2x2": ("fsdp", "v5p:2x2x2", None),
    "fsdp_tp@v5p:2x2x2": ("fsdp_tp", "v5p:2x2x2", None),
    "hsdp@v5p:2x2x2": ("hsdp", "v5p:2x2x2", (2, 4)),  # replica:2 x data:4
    "fsdp_tp@h100:8": ("fsdp_tp", "h100:8", None),
    "dp@h100:1": ("dp", "h100:1", None),
}
# Strategies whose every matrix is split over the devices the batch is split on: a weight
# gradient all-reduced whole in float32 there should have been reduce-scattered.
SHARDED_WEIGHTS = ("fsdp", "fsdp_tp", "hsdp")


def _run():
    from nnx_zoo.training.config import RunConfig

    return RunConfig.from_config_dict(
        {
            "model": {
                "preset": "tiny",
                "vocab_size": 32768,
                "hidden_dim": 256,
                "num_heads": 8,
                "num_kv_heads": 8,
                "head_dim": 32,
                "ffn_dim": 512,
                "dtype": "bfloat16",
                "remat": "full",
            },
            "data": {"seq_len": 256, "global_batch_size": 8},
            "training": {"loss_chunk_size": 128},
        }
    )


def _version() -> str:
    return ".".join(jax.__version__.split(".")[:2])


def figures(plan) -> dict:
    """What a budget holds: per-device temp bytes, and per collective kind the bytes of its
    arrays per step (executions x array bytes, as `Plan.to_json()['collective_bytes']`)."""
    by_kind: dict[str, int] = {}
    for c in plan.collectives:
        by_kind[c.op] = by_kind.get(c.op, 0) + c.executions * c.array_bytes
    return {"temp_bytes": int(plan.temp_bytes), "collective_bytes": dict(sorted(by_kind.items()))}


# The five compiles are this module's cost (each a 2-layer step: seconds for GPU, ~10-20 s
# for TPU on a 2-core host); every test reads them.
@pytest.fixture(scope="module")
def plans():
    from nnx_zoo.planning.compile import Candidate, compile_plan, make_target
    from shardings import get_strategy

    run = _run()
    cfg = run.model.decoder_config()
    out = {}
    for name, (strategy, topology, shape) in PLANS.items():
        target = make_target(topology)
        shape = shape or get_strategy(strategy).default_mesh_shape(len(target.devices), cfg)
        out[name] = compile_plan(run, Candidate(strategy, shape, "full", 1), target)
    if WRITE:
        golden = _read_golden() if os.path.exists(GOLDEN) else {}
        golden[_version()] = {name: figures(plan) for name, plan in out.items()}
        with open(GOLDEN + ".tmp", "w") as f:
            json.dump(golden, f, indent=1, sort_keys=True)
            f.write("\n")
        os.replace(GOLDEN + ".tmp", GOLDEN)
    return out


def _read_golden() -> dict:
    with open(GOLDEN) as f:
        return json.load(f)


def _budgets() -> dict:
    golden = _read_golden()
    assert _version() in golden, (
        f"no budgets for jax {_version()} in {GOLDEN} (have {sorted(golden)}): write them "
        "with NNX_ZOO_WRITE_BUDGETS=1 (module docstring) and review them"
    )
    return golden[_version()]


def _within(measured: int, budget: int) -> bool:
    if budget < FLOOR_BYTES:
        return measured < FLOOR_BYTES
    return abs(measured - budget) <= TOLERANCE * budget


@pytest.mark.tpu_compile
@pytest.mark.gpu_compile
@pytest.mark.parametrize("name", sorted(PLANS))
def test_plan_within_its_budget(plans, name):
    budget, measured = _budgets()[name], figures(plans[name])
    assert _within(measured["temp_bytes"], budget["temp_bytes"]), (name, measured, budget)
    kinds = set(budget["collective_bytes"]) | set(measured["collective_bytes"])
    for kind in sorted(kinds):
        got = measured["collective_bytes"].get(kind, 0)
        want = budget["collective_bytes"].get(kind, 0)
        assert _within(got, want), (name, kind, got, want, measured, budget)


@pytest.mark.tpu_compile
@pytest.mark.gpu_compile
@pytest.mark.parametrize("name", sorted(n for n in PLANS if PLANS[n][0] in SHARDED_WEIGHTS))
def test_no_weight_gradient_is_all_reduced_whole_in_float32(plans, name):
    """Under a sharded-weight strategy each weight's gradient lands in its shards: no
    all-reduce moves a float32 array the size of a whole weight matrix (the smallest, the
    attention's [M, N*D], bounds them all here; the LM head [M, V] is 32x that)."""
    cfg = _run().model.decoder_config()
    smallest_weight_f32 = 4 * cfg.hidden_dim * cfg.num_heads * cfg.head_dim
    whole = [
        c
        for c in plans[name].collectives
        if c.op == "all-reduce"
        and "data" in c.axes
        and "f32" in c.dtypes
        and c.array_bytes >= smallest_weight_f32
    ]
    assert not whole, [(c.name, c.array_bytes, c.axes) for c in whole]


def test_budgets_cover_both_legs():
    """Both CI legs' jax minor versions have budgets (the floor's and the newest's)."""
    golden = _read_golden()
    assert {"0.10", "0.12"} <= set(golden), sorted(golden)
    for version, budgets in golden.items():
        assert set(budgets) == set(PLANS), (version, sorted(budgets))
