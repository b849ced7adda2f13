"""What every entry point owes a user and a scheduler (issue 40): `--help` exits 0 for every
entry point and every installed console script, a typo'd `--config` lists the shipped
configs, and plan_main names the cause train_main names for the same flags. (A preempted run's
exit status is checked where a run is preempted: tests/test_resume.py, test_process_faults.py.)
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import tomllib

import _entry
import jax
import pytest
from _train_helpers import child_env, cli_flags, run_config

from nnx_zoo.launch.build import plan_run
from nnx_zoo.launch.config_files import names
from shardings import get_strategy

with open(f"{_entry.ROOT}/pyproject.toml", "rb") as f:
    SCRIPTS = tomllib.load(f)["project"]["scripts"]


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_console_script_help_exits_0(script, capsys):
    """`zoo-train --help` runs `train_main:run` with argv[0] = the script's name."""
    module, function = SCRIPTS[script].split(":")
    entry = getattr(importlib.import_module(module), function)
    with pytest.raises(SystemExit) as exit_:
        entry([script, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "flags:" in out and "--verbosity" in out


@pytest.mark.parametrize(
    "module", ["train_main", "eval_main", "plan_main", "explain_main", "export_main", "data_main"]
)
def test_entry_point_help_exits_0(module):
    result = _entry.run_main(module, ["--help"])
    assert result.returncode == 0, result.stderr
    assert "flags:" in result.stdout


@pytest.mark.parametrize("module", ["train_main", "plan_main"])
def test_misspelt_config_lists_the_shipped_ones(module):
    topology = ["--topology=cpu:8"] if module == "plan_main" else []
    result = _entry.run_main(module, ["--config=tinyy", *topology])
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("error: --config=tinyy: cannot load the config file")
    assert f"shipped configs: {', '.join(names())}" in lines[0]
    assert "tiny" in names() and "llama3_1b" in names()


# SMALL_RUN's shapes with 4 layers, which do not split into 3 stages.
SHAPES = {"model.num_layers": 4, "model.hidden_dim": 64, "model.head_dim": 8, "model.ffn_dim": 128}
STAGES = ["--sharding_strategy=fsdp_pp", "--mesh_shape=data:1,stage:3", *cli_flags(SHAPES)]


@pytest.mark.parametrize(
    "batch,cause",
    [
        # The stages do not divide the layers (before: "nothing fits in 16.0 GiB per chip").
        (12, r"its dim 0 \(size 4\) is split over mesh axis stage=3, which does not divide it"),
        # The batch is split over data x stage (before: "over the data axis of 3 devices").
        (16, r"batch size 16 is split over mesh axis data=1xstage=3, which does not divide it"),
    ],
    ids=["stages_vs_layers", "batch_vs_data_x_stage"],
)
def test_plan_main_names_train_mains_cause(batch, cause):
    flags = [*STAGES, f"--config.data.global_batch_size={batch}"]
    environ = dict(os.environ)
    plan = _entry.plan(["--topology=cpu:3", *flags])
    # plan_main asks XLA for 3 CPU devices at import; run in this worker, that must not
    # reach the processes later tests start (seen: a bench child on 3 devices, not 8).
    assert dict(os.environ) == environ
    lines = plan.stderr.strip().splitlines()
    assert plan.returncode == 2 and len(lines) == 1, plan.stderr[-2000:]
    assert re.search(cause, lines[0]), lines[0]
    assert "nothing fits" not in plan.stdout + plan.stderr
    # The line train_main's build check gives for the same run on 3 devices.
    run = run_config(
        {**SHAPES, "data.global_batch_size": batch, "training.sharding_strategy": "fsdp_pp"}
    )
    strategy = get_strategy("fsdp_pp")
    mesh = strategy.make_mesh(shape="data:1,stage:3", devices=jax.devices()[:3])
    with pytest.raises(ValueError) as train_error:
        plan_run(run, mesh)
    assert lines[0] == f"error: {train_error.value}"


def test_grain_workers_start_outside_an_absl_app():
    """The Python API with `num_workers` (a script or notebook that never parses absl flags):
    Grain's workers read absl flags as they start, which raised UnparsedFlagAccessError
    (issue 40, finding 7). A fresh process is the subject: absl's parsed state is global."""
    code = (
        "from nnx_zoo.data.pipeline import make_dataset\n"
        "from nnx_zoo.data.tokenizers import make_tokenizer\n"
        "it = make_dataset('default', 'train', make_tokenizer('byte'), 64, 16,\n"
        "                  process_index=0, process_count=1, num_workers=2)\n"
        "print('batch', next(it)['tokens'].shape)\n"
        "it.close()\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        env=child_env(1),
        cwd=_entry.ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "batch (16, 64)" in result.stdout, result.stderr[-3000:]
    assert "UnparsedFlagAccessError" not in result.stderr
