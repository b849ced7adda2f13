"""`data.validation_source` (issue 46 item 5): a separate held-out source, validated on whole,
while the training source trains whole; a missing one is a one-line error at start."""

from __future__ import annotations

import json

import jax
import numpy as np
from _train_helpers import SMALL_RUN, cli_flags, run_config, run_train_main
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from nnx_zoo import data
from nnx_zoo.data.tokenizers import ByteTokenizer
from nnx_zoo.evaluation.settings import from_run_info
from nnx_zoo.launch.data import build_data

RUN = {
    **SMALL_RUN,
    "optimizer.warmup_steps": 0,
    "training.steps": 2,
    "training.eval_every": 0,
    "training.eval_batches": 1,
}


def _sources(tmp_path):
    train = tmp_path / "train.txt"
    train.write_text("\n\n".join(f"def f{i}(x):\n    return x * {i}" for i in range(60)))
    held = tmp_path / "held.jsonl"
    held.write_text(
        "".join(json.dumps({"text": f"held-out text {i} " * 5}) + "\n" for i in range(9))
    )
    return str(train), str(held)


def test_validation_batches_come_whole_from_the_held_out_source(tmp_path):
    """The run's validation batches are the held-out source's split 'all'; its training
    stream is the whole training source's (split 'all', not 'train')."""
    train, held = _sources(tmp_path)
    run = run_config({**RUN, "data.source": train, "data.validation_source": held})
    mesh = Mesh(np.array(jax.devices()[:1]), ("data",))
    d = run.data
    got = build_data(run, mesh, P())
    try:
        kw = dict(seq_len=d.seq_len, global_batch_size=d.global_batch_size, seed=d.shuffle_seed)
        kw |= dict(process_index=0, process_count=1)
        want_val = data.build_dataset(held, "all", ByteTokenizer(), num_batches=1, **kw)
        for g, w in zip(got.make_val_batches(), want_val, strict=True):
            np.testing.assert_array_equal(np.asarray(g["tokens"]), w["tokens"])
        want_train = data.make_dataset(
            train, "all", ByteTokenizer(), shuffle=True, repeat=True, **kw
        )
        for _ in range(3):
            np.testing.assert_array_equal(
                np.asarray(next(got.train_batches)["tokens"]), next(want_train)["tokens"]
            )
    finally:
        got.close()
    # eval_main's held-out metrics read the run's record: its held-out source, whole.
    settings = from_run_info({"config": run.to_dict()})
    assert (settings.source, settings.split) == (held, "all")
    assert from_run_info({"config": run.to_dict()}, data=train).source == train


def test_a_run_validates_on_the_held_out_source(tmp_path):
    train, held = _sources(tmp_path)
    flags = cli_flags({**RUN, "data.source": train, "data.validation_source": held})
    result = run_train_main([f"--workdir={tmp_path / 'run'}", *flags])
    assert result.returncode == 0, result.stderr[-3000:]
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    val = [r["val_loss"] for r in records if "val_loss" in r]
    assert len(val) == 1 and 0 < val[0] < 10, records


def test_a_missing_validation_source_is_one_line_exit_2(tmp_path):
    train, _ = _sources(tmp_path)
    missing = str(tmp_path / "nowhere.jsonl")
    flags = cli_flags({**RUN, "data.source": train, "data.validation_source": missing})
    result = run_train_main([f"--workdir={tmp_path / 'run'}", *flags])
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith("error: ") and lines[0].endswith(
        f"data.validation_source: data path {missing!r} does not exist"
    )
