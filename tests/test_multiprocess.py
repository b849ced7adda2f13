"""Two processes with 4 CPU devices each train the run of one process with 8, and a run moves
between one and two processes through its checkpoints.

The processes meet through `jax.distributed` on localhost (gloo collectives on CPU). Every
process builds the whole global batch and keeps its rows of it (nnx_zoo/data/pipeline.py), so the
reference is a plain one-process run, and the losses must match it (within float32
reassociation: see the tolerance).

Three layouts: `fsdp_tp` (`data` spans both processes), `hsdp`, where each process plays
one slice: the default mesh puts `replica` across the processes and `data` inside each, and
`fsdp_ep` on the tiny Qwen3-MoE, whose 8 experts put every device on `expert`: the token
all-to-all of every MoE layer crosses the processes. `fsdp_tp` runs the elastic chain: one
process to step 3, two processes from its checkpoint to step 6, one process again to step 9,
against one process from 1 to 9 (the global batches themselves: test_elastic_data.py). And one
run reads a zoo-data token store, where each process reads only its own rows (data/rows.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import jax
import numpy as np
import portpicker
import pytest
from _train_helpers import (
    SMALL_RUN,
    cli_flags,
    peer_flags,
    run_config,
    start_train_main,
    train_losses,
)

RUN = {**SMALL_RUN, "training.steps": 10, "training.eval_every": 0}
# strategy -> (the mesh the two processes choose by default, the mesh the reference is given,
# the slice-crossing axes, run overrides)
CASES = {
    "fsdp_tp": ({"data": 4, "model": 2}, "", ["data"], {}),
    "hsdp": ({"replica": 2, "data": 4}, "replica:2,data:4", ["replica"], {}),
    "fsdp_ep": ({"data": 1, "expert": 8}, "", ["expert"], {"model.preset": "qwen3-moe-tiny"}),
}


def _one_process(workdir: str, strategy: str, overrides: dict | None = None) -> list[float]:
    """A plain run of this (one) process on its 8 devices; the losses of metrics.jsonl."""
    from nnx_zoo.launch import session as train_run

    mesh, mesh_text, _, case = CASES[strategy]
    run = run_config(
        {
            **RUN,
            **case,
            **(overrides or {}),
            "training.sharding_strategy": strategy,
            "training.mesh_shape": mesh_text,
        }
    )
    setup = train_run.prepare(run, workdir)
    assert dict(setup.built.mesh.shape) == mesh
    train_run.train(setup)
    return train_losses(workdir)


# Slurm derives the coordinator's port from the job id: 61440 + SLURM_JOB_ID % 4096.
_SLURM_PORTS = range(65535 - 2**12 + 1, 65536)


def _slurm_env(i: int, port: int, workdir: str) -> dict[str, str]:
    """What `srun --ntasks=2` on one node sets for task i (the variables JAX and
    nnx_zoo/runtime/distributed.py read), with a job id that maps to `port`.

    And a compilation cache of the pair's own: under Slurm's variables JAX gives each process
    other compile options than with flags, so in the session's shared cache one process could
    find its step compiled and the other not; the first waits in gloo's context set-up (a
    30 s deadline) for the other's compile and fails. Both compiling keeps them in step."""
    return {
        "JAX_COMPILATION_CACHE_DIR": os.path.join(os.path.dirname(workdir), "slurm-jax-cache"),
        "SLURM_JOB_ID": str(4096 * 1000 + port - _SLURM_PORTS.start),
        "SLURM_NTASKS": "2",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_PROCID": str(i),
        "SLURM_LOCALID": str(i),
        "SLURM_NODEID": "0",
        "SLURM_STEP_NODELIST": "localhost",
        "SLURM_STEP_NUM_NODES": "1",
        "SLURM_JOB_NODELIST": "localhost",
    }


def _free_slurm_port() -> int:
    for port in np.random.default_rng().permutation(np.array(_SLURM_PORTS)):
        if portpicker.is_port_free(int(port)):
            return int(port)
    raise RuntimeError("no free port in Slurm's coordinator range")


def _two_processes(
    workdir: str, strategy: str, overrides: dict | None = None, *, slurm: bool = False
) -> list[str]:
    """train_main as two processes of 4 devices each; their stdout, after checking that both
    exit 0, that only process 0 speaks, and the mesh they record. `slurm`: started as srun
    starts them, with Slurm's variables and no process flags (JAX finds its coordinator)."""
    port = _free_slurm_port() if slurm else portpicker.pick_unused_port()

    def process_flags(i):
        return [] if slurm else peer_flags(port, i)

    children = [
        start_train_main(
            [
                f"--workdir={workdir}",
                *process_flags(i),
                f"--sharding_strategy={strategy}",
                *cli_flags({**RUN, **CASES[strategy][3], **(overrides or {})}),
            ],
            num_devices=4,
            env=_slurm_env(i, port, workdir) if slurm else None,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outputs = []
    try:
        for child in children:
            outputs.append(child.communicate(timeout=600))
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
    for child, (_, err) in zip(children, outputs, strict=True):
        assert child.returncode == 0, err[-3000:]
    # Process 1 prints none of the run's lines (gloo's own connection lines may appear).
    assert "2 processes" in outputs[0][0] and "done:" in outputs[0][0]
    assert "Config: " in outputs[0][0]
    assert "Config: " not in outputs[1][0] and "done:" not in outputs[1][0]
    # The first line names the platform JAX chose, every process's devices (process 0 only).
    first = f"jax {jax.__version__} on cpu: 8 x cpu devices in 2 processes"
    assert outputs[0][0].splitlines()[0] == first and first not in outputs[1][0]
    with open(os.path.join(workdir, "run_info.json")) as f:
        info = json.load(f)
    assert info["mesh_shape"] == CASES[strategy][0]
    # Only `replica` joins devices of different processes ("slices") under hsdp.
    assert info["slice_crossing_axes"] == CASES[strategy][2]
    return [out for out, _ in outputs]


# The processes hold the same arrays on the same 8 device positions; the cross-process
# all-reduce (gloo) may add partial sums in another order than the in-process one, so float32
# reassociation only.
RTOL = 1e-5


@pytest.fixture(scope="module")
def hsdp_pair(tmp_path_factory) -> list[float]:
    """The hsdp run as two processes started with explicit flags: its losses."""
    workdir = str(tmp_path_factory.mktemp("hsdp_pair") / "two")
    _two_processes(workdir, "hsdp")
    return train_losses(workdir)


# Among the slowest on CI (fsdp_ep 45 s on the floor leg, 50 s on the newest, 2026-11-27): two
# train_main processes over gloo, then the one-process run. Their subject is JAX's multi-process
# runtime, which only separate processes exercise; the hsdp pair is made once and also serves the
# Slurm test.
@pytest.mark.parametrize("strategy", ["hsdp", "fsdp_ep"])
def test_two_processes_equal_one(tmp_path, strategy, request):
    if strategy == "hsdp":
        two_process = request.getfixturevalue("hsdp_pair")
    else:
        _two_processes(str(tmp_path / "two"), strategy)
        two_process = train_losses(str(tmp_path / "two"))
    # Only process 0 writes: one metrics file, one line per step.
    assert len(two_process) == RUN["training.steps"]
    one_process = _one_process(str(tmp_path / "one"), strategy)
    np.testing.assert_allclose(two_process, one_process, rtol=RTOL)
    assert one_process[0] - one_process[-1] > 0.5  # the losses move: equality means something


def test_slurm_variables_form_the_run(tmp_path, hsdp_pair):
    """Two processes as `srun --ntasks=2` starts them (docs/cluster.md): Slurm's variables and
    no --coordinator_address / --num_processes / --process_id. They find each other (JAX's
    Slurm detection: the first node of SLURM_STEP_NODELIST, a port from SLURM_JOB_ID) and run
    the explicit-flags run, loss for loss: the same processes, devices and collectives."""
    out, _ = _two_processes(str(tmp_path / "slurm"), "hsdp", slurm=True)
    assert "2 processes" in out
    np.testing.assert_array_equal(train_losses(str(tmp_path / "slurm")), hsdp_pair)


# 27-34 s on CI (2026-11-27): an uninterrupted one-process run, two processes that save, and
# one process that resumes; a checkpoint crossing process counts needs those processes.
def test_a_run_moves_between_one_and_two_processes(tmp_path, capsys):
    saving = {"checkpoint.enabled": True, "checkpoint.every": 3, "checkpoint.keep": 3}
    run = {**saving, "training.steps": 9}
    uninterrupted = _one_process(str(tmp_path / "one"), "fsdp_tp", run)
    # The same run up to its first checkpoint (step 3, written by one process).
    workdir = str(tmp_path / "moved")
    shutil.copytree(tmp_path / "one", workdir)
    for step in ("6", "9"):
        shutil.rmtree(os.path.join(workdir, "checkpoints", step))
    capsys.readouterr()
    # 1 -> 2 processes, steps 4-6 (keeping the 9-step schedule), saved at 6 by two processes.
    (out, _) = _two_processes(workdir, "fsdp_tp", {**saving, "training.steps": 6})
    assert "resumed from step 3" in out
    # 2 -> 1 process, steps 7-9.
    _one_process(workdir, "fsdp_tp", run)
    assert "resumed from step 6" in capsys.readouterr().out
    moved = train_losses(workdir)
    assert len(moved) == 9
    np.testing.assert_allclose(moved, uninterrupted, rtol=RTOL)
    assert uninterrupted[3] - uninterrupted[-1] > 0.3  # steps 4-9 move: equality means something


def test_two_processes_reading_a_token_store_equal_one(tmp_path):
    """From a zoo-data store each process reads only its rows of each global batch
    (nnx_zoo/data/rows.py); the losses are still the one-process run's."""
    from nnx_zoo.data.tokenize_corpus import Request, tokenize_corpus

    corpus = tmp_path / "corpus.jsonl"
    with open(corpus, "w") as f:
        for i in range(600):
            f.write(json.dumps({"text": f"{i}: " + "lorem ipsum " * (i % 13 + 1)}) + "\n")
    store = str(tmp_path / "store")
    tokenize_corpus(Request(str(corpus), "byte", store, shard_bytes=20_000), log=lambda _: None)
    run = {"data.source": store}
    _two_processes(str(tmp_path / "two"), "fsdp_tp", run)
    two_process = train_losses(str(tmp_path / "two"))
    one_process = _one_process(str(tmp_path / "one"), "fsdp_tp", run)
    np.testing.assert_allclose(two_process, one_process, rtol=RTOL)
    assert one_process[0] - one_process[-1] > 0.5  # the losses move: equality means something
