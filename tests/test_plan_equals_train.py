"""plan_main plans the step train_main runs: the same command line gives the same compiled
program and the same memory figures, byte for byte (one assembly, launch.build, and one
formula, training.step_memory)."""

from __future__ import annotations

import json
import re

import _entry
import jax
import pytest
from model_utils import count_constructions

from nnx_zoo.launch.build import build, plan_run
from nnx_zoo.launch.data import build_data
from nnx_zoo.training.config import RunConfig

# A run that differs from the tiny config's defaults in what the planner used to drop:
# the loss chunk, remat and micro-batches.
RUN_FLAGS = [
    "--config=configs/tiny.py",
    "--sharding_strategy=fsdp_tp",
    "--mesh_shape=data:4,model:2",
    "--config.training.loss_chunk_size=256",
    "--config.model.remat=dots",
    "--config.optimizer.micro_batches=2",
    "--config.data.global_batch_size=16",
    "--config.data.seq_len=64",
]
TRAIN_ONLY = [
    "--config.training.steps=2",
    "--config.optimizer.warmup_steps=0",
    "--config.training.eval_batches=1",
    "--config.checkpoint.enabled=False",
    "--config.logging.progress_bar=False",
]


def _run(script, args):
    """The entry point in this process (tests/_entry.py), on its 8 devices."""
    return _entry.run_main(script.removesuffix(".py"), args)


def _plan(args) -> dict:
    result = _run("plan_main.py", [*args, "--topology=cpu:8", "--json"])
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 1, result.stdout
    return rows[0]


@pytest.fixture(scope="module")
def trained_memory(tmp_path_factory) -> dict:
    workdir = tmp_path_factory.mktemp("run")
    result = _run("train_main.py", [*RUN_FLAGS, *TRAIN_ONLY, f"--workdir={workdir}"])
    assert result.returncode == 0, result.stderr[-3000:]
    with open(workdir / "run_info.json") as f:
        return json.load(f)["memory"]


def test_run_info_memory_equals_plan_main_for_the_same_command_line(trained_memory):
    plan = _plan(RUN_FLAGS)
    assert plan["micro_batches"] == 2 and plan["remat"] == "dots"
    assert trained_memory, "train_main recorded no memory"
    for key, value in trained_memory.items():
        assert plan[key] == value, (key, plan[key], value)


def test_short_flags_are_aliases_of_the_config_fields(trained_memory):
    short = [f for f in RUN_FLAGS if "data.global_batch_size" not in f and "data.seq_len" not in f]
    plan = _plan([*short, "--batch_size=16", "--seq_len=64"])
    for key, value in trained_memory.items():
        assert plan[key] == value, key
    # An alias that disagrees with the field it stands for is refused in one line.
    result = _run("plan_main.py", [*RUN_FLAGS, "--batch_size=8", "--topology=cpu:8"])
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--batch_size=8 disagrees with" in errors[0], result.stderr


def test_a_full_train_main_command_line_plans_the_same(trained_memory, tmp_path):
    """train_main's flags that say where and how it runs, not what step (--workdir, the
    process flags, --peak_tflops), are accepted and change nothing: the pasted command line
    plans byte for byte what the run recorded."""
    where = [
        f"--workdir={tmp_path / 'run'}",
        "--peak_tflops=100",
        "--coordinator_address=localhost:1234",
        "--num_processes=1",
        "--process_id=0",
    ]
    plan = _plan([*RUN_FLAGS, *TRAIN_ONLY, *where])
    for key, value in trained_memory.items():
        assert plan[key] == value, (key, plan[key], value)


def test_init_from_plans_the_checkpoints_model(trained_memory, tmp_path):
    """--init_from=HF_DIR plans the architecture in HF_DIR's config.json, as train_main builds
    it, over the config's model section: a save_pretrained checkpoint of configs/tiny.py's
    model, given with a config that says 2 layers instead of its 4, plans byte for byte what
    the 4-layer run recorded."""
    from _train_helpers import run_config
    from flax import nnx

    from shardings import get_strategy
    from zoo import create_model, save_pretrained

    strategy = get_strategy("dp")
    mesh = strategy.make_mesh(devices=jax.devices()[:1])
    with jax.set_mesh(mesh):
        model = create_model(run_config({}).model.decoder_config(), strategy, rngs=nnx.Rngs(0))
        save_pretrained(model, str(tmp_path / "hf"))
    flags = [*RUN_FLAGS, "--config.model.num_layers=2", f"--init_from={tmp_path / 'hf'}"]
    plan = _plan([*flags, f"--workdir={tmp_path / 'run'}"])
    for key, value in trained_memory.items():
        assert plan[key] == value, (key, plan[key], value)


def test_abstract_and_concrete_builds_compile_the_same_program(monkeypatch):
    """In process: the planner's abstract build and train_main's concrete one, lowered on a
    batch from the data pipeline, give the same optimized HLO; both take one plan, so the
    model is constructed twice in all: the plan's shapes and the initialising jit's trace."""
    constructions = count_constructions(monkeypatch)
    raw = {
        "model": {"preset": "tiny", "remat": "dots"},
        "data": {"seq_len": 64, "global_batch_size": 16},
        "training": {"sharding_strategy": "fsdp_tp", "loss_chunk_size": 256, "eval_batches": 1},
        "optimizer": {"micro_batches": 2},
    }
    run = RunConfig.from_config_dict(raw)
    plan = plan_run(run)  # one plan, both builds
    mesh = plan.mesh
    abstract, _ = build(run, plan=plan, abstract=True).compile()
    assert constructions["n"] == 1  # the abstract build placed the plan's shapes
    concrete = build(run, plan=plan)
    assert constructions["n"] == 2
    batch = next(build_data(run, mesh, concrete.batch_spec).train_batches)
    with jax.set_mesh(mesh):
        compiled = concrete.trainer.lower(batch).compile()
    assert _program(compiled) == _program(abstract)


def _program(compiled) -> str:
    """The optimized HLO without source metadata (which names the Python that traced it)."""
    text = compiled.as_text()
    text = text.split("\nFileNames")[0]
    text = re.sub(r", metadata=\{[^}]*\}", "", text)
    return re.sub(r", stack_frame_id=\d+", "", text)
