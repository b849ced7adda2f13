"""A training run with the chunked LM head + loss follows the curve of the full-logits run,
and records the compiled step's memory (8 simulated CPU devices, fsdp_tp: vocab on `model`).

Both runs start from the same parameters and see the same batches; the chunked loss equals
the full one to float32 rounding (tests/test_chunked_loss.py), and AdamW carries that
rounding forward. Measured over these 20 steps: at most 2e-6 relative on the training and
validation losses. RTOL = 1e-4 leaves a 50x margin and is far below a real difference (a
wrong mask or a dropped vocab shard moves the first loss by >1e-2).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from _train_helpers import SMALL_RUN, run_config

RTOL = 1e-4
# 4 rows per device under fsdp_tp (data:4): 64 tokens per device = 16 positions per chunk,
# so each 64-token row is walked in 4 chunks.
CHUNKED = 64
RUN = {**SMALL_RUN, "training.steps": 20, "training.eval_every": 10}


def _train(workdir, loss_chunk_size):
    from nnx_zoo.launch import session as train_run

    run = run_config({**RUN, "training.loss_chunk_size": loss_chunk_size})
    setup = train_run.prepare(run, str(workdir))
    records = train_run.train(setup)
    losses = [r["loss"] for r in records if "loss" in r]
    val_losses = [r["val_loss"] for r in records if "val_loss" in r]
    with open(os.path.join(workdir, "run_info.json")) as f:
        info = json.load(f)
    return losses, val_losses, info


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return {
        chunk: _train(tmp_path_factory.mktemp(f"chunk{chunk}"), chunk) for chunk in (0, CHUNKED)
    }


def test_chunked_run_follows_the_full_logits_curve(runs):
    ref_losses, ref_val, _ = runs[0]
    losses, val, _ = runs[CHUNKED]
    assert len(losses) == RUN["training.steps"] and len(val) == 2
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    np.testing.assert_allclose(val, ref_val, rtol=RTOL)
    # Guards the comparison: the curve moves far more than the tolerance.
    assert ref_losses[0] - ref_losses[-1] > 1.0


def test_run_info_records_the_compiled_step_memory(runs):
    for chunk, (_, _, info) in runs.items():
        assert info["config"]["training"]["loss_chunk_size"] == chunk
        memory = info["memory"]
        # training.step_memory's figures, the same plan_main reports (test_plan_equals_train).
        assert set(memory) == {
            "argument_bytes",
            "output_bytes",
            "alias_bytes",
            "temp_bytes",
            "peak_bytes",
            "host_temp_bytes",
            "required_bytes",
        }
        assert 0 < memory["argument_bytes"] < memory["peak_bytes"]
        assert 0 < memory["temp_bytes"] < memory["peak_bytes"]
