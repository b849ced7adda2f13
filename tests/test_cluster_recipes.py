"""The cluster recipes of docs/cluster.md (docs/recipes/) parse, and requeue on the status a
preempted-and-saved run exits with; under Slurm with one task per host, each process keeps
every local GPU (JAX alone would give each task one, by SLURM_LOCALID).

The 2-process run under Slurm's variables is in tests/test_multiprocess.py.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess

import jax
import pytest
import yaml
from _entry import ROOT

from nnx_zoo.runtime import distributed
from nnx_zoo.runtime.preemption import EXIT_PREEMPTED

RECIPES = os.path.join(ROOT, "docs", "recipes")
SCRIPTS = sorted(glob.glob(os.path.join(RECIPES, "*.sh")) + glob.glob(f"{RECIPES}/*.sbatch"))
MANIFESTS = sorted(glob.glob(os.path.join(RECIPES, "*.yaml")))


def test_there_are_recipes_for_slurm_gpu_and_tpu():
    names = {os.path.basename(p) for p in SCRIPTS + MANIFESTS}
    assert {"slurm_train.sbatch", "jobset_gpu.yaml", "jobset_tpu.yaml", "xpk_tpu.sh"} <= names


@pytest.mark.parametrize("path", SCRIPTS, ids=os.path.basename)
def test_scripts_parse(path):
    result = subprocess.run(["bash", "-n", path], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_slurm_script_runs_one_task_per_host_and_requeues_on_the_preempted_status():
    with open(os.path.join(RECIPES, "slurm_train.sbatch")) as f:
        text = f.read()
    assert "#SBATCH --ntasks-per-node=1" in text and "#SBATCH --requeue" in text
    assert re.search(r"^srun .*\\\n\s+python train_main\.py", text, re.M)
    commands = [line for line in text.splitlines() if not line.startswith("#")]
    assert not any("--coordinator_address" in c for c in commands)  # JAX reads Slurm's
    assert f"EXIT_PREEMPTED={EXIT_PREEMPTED}" in text
    assert 'scontrol requeue "$SLURM_JOB_ID"' in text


@pytest.mark.parametrize("path", MANIFESTS, ids=os.path.basename)
def test_jobsets_parse_and_restart_on_the_preempted_status(path):
    with open(path) as f:
        manifest = yaml.safe_load(f)
    assert manifest["kind"] == "JobSet"
    (job,) = manifest["spec"]["replicatedJobs"]
    spec = job["template"]["spec"]
    rules = spec["podFailurePolicy"]["rules"]
    by_action = {
        tuple(r["onExitCodes"]["values"]): r["action"] for r in rules if "onExitCodes" in r
    }
    assert by_action[(EXIT_PREEMPTED,)] == "Ignore"  # restarted, not counted as a failure
    assert by_action[(2,)] == "FailJob"  # a mistake in the input fails at once
    (container,) = spec["template"]["spec"]["containers"]
    command = " ".join(container["command"])
    assert "train_main.py" in command
    assert spec["parallelism"] == spec["completions"]  # one pod per host, all of them


@pytest.mark.parametrize(
    "per_node,keeps_all", [("1(x2)", True), ("1", True), ("8(x2)", False), ("1,2", False)]
)
def test_one_slurm_task_per_host_keeps_every_gpu(monkeypatch, per_node, keeps_all):
    """JAX's Slurm detection narrows each process to GPU SLURM_LOCALID; distributed._join
    widens it again when Slurm runs one task per node. (jax.distributed.initialize itself
    is replaced: what it sets is the subject, not the connection.)"""

    def initialize(**_):  # what JAX does with local_device_ids=[SLURM_LOCALID]
        jax.config.update("jax_cuda_visible_devices", "0")

    monkeypatch.setattr(jax.distributed, "initialize", initialize)
    for var, value in {
        "SLURM_JOB_ID": "7",
        "SLURM_NTASKS": "2",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_STEP_NODELIST": "node[1-2]",
        "SLURM_STEP_TASKS_PER_NODE": per_node,
    }.items():
        monkeypatch.setenv(var, value)
    preemption_service = jax.config.jax_enable_preemption_service
    try:
        distributed._join(0.0)
        assert jax.config._read("jax_cuda_visible_devices") == ("all" if keeps_all else "0")
    finally:
        jax.config.update("jax_cuda_visible_devices", "all")
        jax.config.update("jax_rocm_visible_devices", "all")
        jax.config.update("jax_enable_preemption_service", preemption_service)
