"""Two processes with 4 CPU devices each train the run of one process with 8.

The processes meet through `jax.distributed` on localhost (gloo collectives on CPU). Each reads
its own half of the documents (the pipeline shards by process), so the global batch of step s
is process 0's local batch followed by process 1's (process 0 owns the first half of the
batch axis). The one-process reference feeds exactly those global batches, built here from
the same two shards, and must give the same losses.

Two layouts: `fsdp_tp` (`data` spans both processes) and `hsdp`, where each process plays
one slice: the default mesh puts `replica` across the processes and `data` inside each.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import portpicker
import pytest
from _train_helpers import (
    ROOT,
    SMALL_RUN,
    TRAIN_MAIN,
    child_env,
    cli_flags,
    run_config,
    train_losses,
)

RUN = {**SMALL_RUN, "training.steps": 10, "training.eval_every": 0}
# strategy -> (the mesh the two processes choose by default, the mesh the reference is given)
CASES = {
    "fsdp_tp": ({"data": 4, "model": 2}, ""),
    "hsdp": ({"replica": 2, "data": 4}, "replica:2,data:4"),
}


def _reference_losses(workdir: str, strategy: str) -> list[float]:
    """The 8-device, one-process run fed the two processes' batches, concatenated."""
    import data
    from data.tokenizers import make_tokenizer
    from launch import session as train_run
    from runtime.distributed import to_global

    mesh, mesh_text = CASES[strategy]
    run = run_config(
        {**RUN, "training.sharding_strategy": strategy, "training.mesh_shape": mesh_text}
    )
    setup = train_run.prepare(run, workdir)
    assert dict(setup.built.mesh.shape) == mesh
    shards = [
        data.make_dataset(
            run.data.source,
            "train",
            make_tokenizer(run.data.tokenizer),
            run.data.seq_len,
            run.data.global_batch_size,
            run.data.shuffle_seed,
            process_index=i,
            process_count=2,
        )
        for i in range(2)
    ]

    def two_process_batches():
        while True:
            local = [next(it) for it in shards]
            # The shards hold different documents: the concatenation is not a duplicate.
            assert not np.array_equal(local[0]["tokens"], local[1]["tokens"])
            batch = {k: np.concatenate([b[k] for b in local]) for k in local[0]}
            yield to_global(batch, setup.built.mesh, setup.built.batch_spec)

    setup.data.train_batches = two_process_batches()
    train_run.train(setup)
    return train_losses(workdir)


@pytest.mark.parametrize("strategy", list(CASES))
def test_two_processes_equal_one(tmp_path, strategy):
    port = portpicker.pick_unused_port()
    workdir = str(tmp_path / "two")
    children = [
        subprocess.Popen(
            [
                sys.executable,
                TRAIN_MAIN,
                f"--workdir={workdir}",
                f"--coordinator_address=localhost:{port}",
                "--num_processes=2",
                f"--process_id={i}",
                f"--sharding_strategy={strategy}",
                *cli_flags(RUN),
            ],
            env=child_env(num_devices=4),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outputs = []
    try:
        for child in children:
            outputs.append(child.communicate(timeout=300))
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
    for child, (_, err) in zip(children, outputs, strict=True):
        assert child.returncode == 0, err[-3000:]
    # Only process 0 writes: one metrics file, one line per step.
    two_process = train_losses(workdir)
    assert len(two_process) == RUN["training.steps"]
    # Process 1 prints none of the run's lines (gloo's own connection lines may appear).
    assert "2 processes" in outputs[0][0] and "done:" in outputs[0][0]
    assert "LlamaConfig" not in outputs[1][0] and "done:" not in outputs[1][0]

    with open(os.path.join(workdir, "run_info.json")) as f:
        info = json.load(f)
    assert info["mesh_shape"] == CASES[strategy][0]
    # Only `replica` joins devices of different processes ("slices") under hsdp.
    assert info["slice_crossing_axes"] == (["replica"] if strategy == "hsdp" else ["data"])

    one_process = _reference_losses(str(tmp_path / "one"), strategy)
    # Same arrays on the same 8 device positions; the cross-process all-reduce (gloo) may add
    # partial sums in another order than the in-process one, so float32 reassociation only.
    np.testing.assert_allclose(two_process, one_process, rtol=1e-5)
    assert one_process[0] - one_process[-1] > 0.5  # the losses move: equality means something
