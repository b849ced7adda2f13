"""train_main.py end to end on 8 simulated CPU devices: the loss falls and the files exist,
every strategy gives the same losses, bad input exits 2 with one line."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from _stderr import ours
from _train_helpers import (
    ROOT,
    SMALL_RUN,
    char_tokenizer,
    cli_flags,
    run_config,
    run_train_main,
    train_losses,
    train_main_process,
)

# DESIGN.md's public keys, and `mfu_at_precision` (MFU against the peak of the precision the
# projections run in; README "Low-precision training").
CONTRACT_KEYS = {"step", "loss", "learning_rate", "grad_norm", "tokens_per_second", "mfu"}
CONTRACT_KEYS |= {"mfu_at_precision"}


@pytest.fixture(scope="module")
def fsdp_tp_run(tmp_path_factory):
    """One CLI run under fsdp_tp (checkpointing on, CPU peak measured, every output file):
    its workdir."""
    workdir = str(tmp_path_factory.mktemp("fsdp_tp"))
    overrides = {**SMALL_RUN, "checkpoint.enabled": True, "checkpoint.every": 20}
    overrides |= {"logging.tensorboard": True, "logging.loss_curve": True}
    result = run_train_main(
        ["--sharding_strategy=fsdp_tp", f"--workdir={workdir}", *cli_flags(overrides)]
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return workdir


def test_loss_falls_and_files_exist(fsdp_tp_run):
    losses = train_losses(fsdp_tp_run)
    assert len(losses) == SMALL_RUN["training.steps"]
    # Untrained: ln(512) = 6.24 nats (uniform over the model's vocab). After 40 steps on
    # byte-level Python source the model has learned the byte frequencies and common bigrams
    # (measured: ~3.2). A fall of 2 nats is far outside step-to-step noise (~0.15).
    assert losses[0] > 5.5
    assert np.mean(losses[-5:]) < losses[0] - 2.0

    with open(os.path.join(fsdp_tp_run, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    train_records = [r for r in records if "loss" in r]
    for record in train_records:
        assert set(record) >= CONTRACT_KEYS, record
        # MFU is only bounded loosely: on a shared CPU the start-up matmul that measures the
        # peak and the steps can see different loads.
        assert record["tokens_per_second"] > 0 and 0 < record["mfu"] < 10
        # No quantization, and CPU has one peak: the two MFUs are one figure.
        assert record["mfu_at_precision"] == pytest.approx(record["mfu"], rel=1e-12)
    assert [r["step"] for r in train_records] == list(range(1, 41))
    val_steps = [r["step"] for r in records if "val_loss" in r]
    assert val_steps == [20, 40]

    events = os.listdir(os.path.join(fsdp_tp_run, "tensorboard"))
    assert any(name.startswith("events.out.tfevents") for name in events)
    with open(os.path.join(fsdp_tp_run, "loss_curve.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with open(os.path.join(fsdp_tp_run, "run_info.json")) as f:
        info = json.load(f)
    assert info["strategy"] == "fsdp_tp" and info["mesh_shape"] == {"data": 4, "model": 2}
    # Where JAX ran it (nnx_zoo/runtime/host.py): tests/conftest.py's 8 CPU devices.
    assert {k: info["platform"][k] for k in ("backend", "device_kind", "device_count")} == {
        "backend": "cpu",
        "device_kind": "cpu",
        "device_count": 8,
    }


# Same parameters (one seed, built directly in each layout) and the same batches; what differs
# is where XLA splits each sum (per-device partial sums, then an all-reduce), so float32
# results differ by reassociation only. Measured over these 40 steps: at most 2e-7 relative
# (dp, fsdp, and tp too, against fsdp_tp). 1e-5 leaves a 50x margin and is still far below
# any real divergence (a wrong layout or a skipped reduction moves the loss by >1e-3).
STRATEGY_RTOL = 1e-5
# Each strategy's run is the reference's first half: its 40-step learning-rate schedule
# (optimizer.decay_steps=40), so the same rates and batches, and its evaluation at step 20
# runs under the strategy too. The second half would cost each run 20 more steps and an eval
# and compare nothing the first does not: the same compiled steps on later batches.
STRATEGY_STEPS = SMALL_RUN["training.steps"] // 2


# strategy -> its default mesh on 8 devices for this model; fsdp_cp splits T (64) over
# `context` in the train step, the eval step and the loss's shift.
DEFAULT_MESHES = {"dp": {"data": 8}, "fsdp": {"data": 8}, "fsdp_cp": {"data": 4, "context": 2}}


@pytest.mark.parametrize("strategy", list(DEFAULT_MESHES))
def test_strategies_give_the_same_losses(strategy, fsdp_tp_run, tmp_path):
    from nnx_zoo.launch import session as train_run

    overrides = {
        "training.steps": STRATEGY_STEPS,
        "optimizer.decay_steps": SMALL_RUN["training.steps"],
    }
    run = run_config({**SMALL_RUN, **overrides, "training.sharding_strategy": strategy})
    setup = train_run.prepare(run, str(tmp_path))
    assert setup.built.strategy.name == strategy
    assert dict(setup.built.mesh.shape) == DEFAULT_MESHES[strategy]
    train_run.train(setup)
    losses = train_losses(str(tmp_path))
    assert len(losses) == STRATEGY_STEPS
    reference = train_losses(fsdp_tp_run)[:STRATEGY_STEPS]
    np.testing.assert_allclose(losses, reference, rtol=STRATEGY_RTOL)
    # Guards the comparison: the losses move a lot, so equal sequences mean something.
    assert reference[0] - reference[-1] > 1.0


BAD_INPUTS = {
    "unknown strategy": (["--sharding_strategy=zigzag"], "unknown sharding strategy 'zigzag'"),
    "unknown quantization": (
        ["--config.model.quantization=fp4"],
        "config model.quantization='fp4': valid: none, fp8, int8",
    ),
    "bad mesh shape": (["--mesh_shape=data:four,model:2"], "'four' is not an integer"),
    "mesh not matching devices": (
        ["--mesh_shape=data:4,model:4"],
        "needs 16 devices but 8 are available; the axis sizes must multiply to 8; on CPU, "
        "simulate 16 devices by starting with XLA_FLAGS=--xla_force_host_platform_device_count=16",
    ),
    "sequence not splitting over context": (
        [
            "--sharding_strategy=fsdp_cp",
            "--mesh_shape=data:2,context:4",
            "--config.data.seq_len=60",
        ],
        "use a sequence length that is a multiple of 8",
    ),
    "missing data path": (
        ["--config.data.source=/nonexistent/corpus/*.txt"],
        "matches no files",
    ),
    "misspelt config field": (
        ["--config=configs/tiny.py", "--config.optimizer.learnig_rate=1"],
        "--config.optimizer.learnig_rate: no such config field 'learnig_rate'; did you mean "
        "'learning_rate'? (valid in optimizer: b1, b2,",
    ),
    "workdir that is a file": (
        [f"--workdir={os.path.join(ROOT, 'README.md')}"],
        f"--workdir={os.path.join(ROOT, 'README.md')} is a file, not a directory",
    ),
    "field the config file lacks": (
        ["--config=configs/tiny.py", "--config.model.loss_chunk_size=1"],
        "no such config field 'loss_chunk_size' (valid in model: attention_impl, attention_int",
    ),
    "more devices than there are": (
        ["--config.training.num_devices=9"],
        "training.num_devices=9 but 8 devices are available; use 1..8, or 0 for every device",
    ),
    "unknown flag": (["--shardin_strategy=dp"], "shardin_strategy"),
    "missing config file": (["--config=configs/nope.py"], "configs/nope.py"),
    "bad config value": (["--config.optimizer.learning_rate=-1"], "learning_rate"),
    "negative scan unroll": (
        ["--config.model.scan_unroll=-1"],
        "config model.scan_unroll=-1: valid: 0 (auto), 1 (rolled), or more",
    ),
}


# The process's own stderr and exit status, once for each stage a mistake is found in: the
# flags (before JAX starts), the config file's overrides, the build (JAX started: no native
# library line may reach stderr). The rest run in this process (tests/_entry.py).
AS_A_PROCESS = {"unknown flag", "misspelt config field", "mesh not matching devices"}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_exits_2_with_one_line(case, tmp_path):
    args, expected = BAD_INPUTS[case]
    run = train_main_process if case in AS_A_PROCESS else run_train_main
    result = run([f"--workdir={tmp_path}", *args])
    lines = ours(result.stderr).strip().splitlines()  # less JAX's CUDA plugin's lines
    assert result.returncode == 2, result.stderr[-2000:]
    # Exactly one line: the error, naming the problem; nothing else (no trace, no warnings).
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and expected in lines[0], lines[0]
    assert "Traceback" not in result.stdout


@pytest.mark.parametrize("name", ["tiny", "small", "llama3_1b", "llama3_8b"])
def test_configs_parse_and_build_abstractly(name):
    import importlib

    from nnx_zoo.training.config import RunConfig
    from shardings import get_strategy
    from zoo import param_layouts

    config = importlib.import_module(f"configs.{name}").get_config()
    with pytest.raises(AttributeError):  # locked: a misspelt field is an error, not a new one
        config.optimizer.lr_typo = 1.0
    run = RunConfig.from_config_dict(config)
    model_cfg = run.model.decoder_config()
    assert model_cfg.vocab_size >= 257  # covers the byte tokenizer (256 bytes + EOS)
    # Parameters as shapes only (nnx.eval_shape): the real sizes never allocate.
    layouts = param_layouts(model_cfg, get_strategy(run.training.sharding_strategy))
    assert sum(int(np.prod(shape)) for _, shape, _ in layouts) == model_cfg.num_params()
    expected = {"tiny": (0.5e6, 2e6), "small": (90e6, 120e6)}
    expected |= {"llama3_1b": (1.2e9, 1.3e9), "llama3_8b": (7.9e9, 8.1e9)}
    low, high = expected[name]
    assert low < model_cfg.num_params() < high


def test_num_devices_runs_on_the_first_devices():
    """--config.training.num_devices=N: the mesh of an N-device process, over the first N."""
    import jax

    from nnx_zoo.launch.build import plan_run

    mesh = plan_run(run_config({"training.num_devices": 2})).mesh
    assert list(mesh.devices.flat) == jax.devices()[:2] and dict(mesh.shape) == {
        "data": 2,
        "model": 1,
    }
    mesh = plan_run(run_config({"training.num_devices": 0})).mesh
    assert mesh.size == 8
    with pytest.raises(ValueError, match=r"^config training.num_devices=-1: must be >= 0"):
        run_config({"training.num_devices": -1})


def test_init_from_loads_the_checkpoint(tmp_path):
    from safetensors.numpy import load_file

    from nnx_zoo.launch import session as train_run

    hf_dir = os.path.join(os.path.dirname(__file__), "hf_reference", "llama")
    overrides = {**SMALL_RUN, "data.tokenizer": char_tokenizer(tmp_path)[0]}
    setup = train_run.prepare(run_config(overrides), str(tmp_path), init_from=hf_dir)
    # The architecture is the checkpoint's (F=64, V=128), not the config's preset (F=128).
    assert (setup.built.model_cfg.ffn_dim, setup.built.model_cfg.vocab_size) == (64, 128)
    assert setup.info["model_config"]["ffn_dim"] == 64
    weights = load_file(os.path.join(hf_dir, "model-00001-of-00003.safetensors"))
    np.testing.assert_array_equal(
        np.asarray(setup.built.model.embed.table[...]), weights["model.embed_tokens.weight"]
    )


def test_init_from_with_a_too_small_vocab_is_a_usage_error(tmp_path):
    hf_dir = os.path.join(os.path.dirname(__file__), "hf_reference", "llama")
    result = run_train_main([f"--workdir={tmp_path}", f"--init_from={hf_dir}"])
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [
        "error: model vocab_size=128 is smaller than the tokenizer's 257 ids (byte); use the "
        "checkpoint's own tokenizer (--config.data.tokenizer=<its dir>)"
    ]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: c.optimizer.update({"warmup_steps": -1}), "optimizer.warmup_steps"),
        (lambda c: c.model.update({"remat": "some"}), "valid: none, full, dots"),
        (lambda c: c.data.update({"validation_fraction": 1.5}), "data.validation_fraction"),
        (lambda c: c.optimizer.update({"micro_batches": 3}), "must divide"),
    ],
)
def test_run_config_rejects_bad_values_in_one_line(change, message):
    from configs import tiny
    from nnx_zoo.training.config import RunConfig

    config = tiny.get_config()
    change(config)
    with pytest.raises(ValueError, match=message) as info:
        RunConfig.from_config_dict(config)
    assert "\n" not in str(info.value)


def test_run_config_clamps_a_warmup_longer_than_the_schedule_with_a_note():
    from configs import tiny
    from nnx_zoo.training.config import RunConfig

    config = tiny.get_config()
    config.training.steps = 1  # a smoke run of the preset, whose warmup is 20
    notes = []
    run = RunConfig.from_config_dict(config, notes)
    # A warmup as long as the run would leave the cosine decay no step (optax refuses it).
    assert run.optimizer.warmup_steps == 0
    assert len(notes) == 1 and "warming up for 0 steps instead" in notes[0]
    config.training.steps = 200
    assert RunConfig.from_config_dict(config, notes).optimizer.warmup_steps == 20
    assert len(notes) == 1  # nothing to say when it fits


def test_run_config_rejects_unknown_fields_and_wrong_types():
    from nnx_zoo.training.config import RunConfig

    with pytest.raises(ValueError, match=r"unknown fields \['lr'\]"):
        RunConfig.from_config_dict({"optimizer": {"lr": 1.0}})
    with pytest.raises(ValueError, match="training.steps='10': must be an integer"):
        RunConfig.from_config_dict({"training": {"steps": "10"}})
    run = RunConfig.from_config_dict({"optimizer": {"learning_rate": 1}})
    assert run.optimizer.learning_rate == 1.0 and isinstance(run.optimizer.learning_rate, float)
