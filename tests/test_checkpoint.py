"""nnx_zoo/checkpoint/ (manager, steps, restore) and nnx_zoo/runtime/preemption.py in-process:
restore onto other strategies and device counts bit for bit, the incomplete-checkpoint policy,
and the one-line errors."""

import os
import shutil
import signal

import grain
import jax
import numpy as np
import optax
import pytest
from flax import nnx

from nnx_zoo.checkpoint import integrity
from nnx_zoo.checkpoint.manager import Checkpointer
from nnx_zoo.checkpoint.restore import read_meta, restore_params
from nnx_zoo.checkpoint.steps import (
    INVALID_SUBDIR,
    ITEMS,
    CorruptCheckpointError,
    checkpoint_dir,
    complete_steps,
)
from nnx_zoo.errors import UsageError
from nnx_zoo.runtime.preemption import PreemptionWatcher
from shardings import get_strategy
from zoo import create_model, get_config

CFG = get_config("tiny")  # M=64, L=2, stacked layers: every array has a non-trivial layout


def build(strategy_name, shape, devices=None, seed=0, cfg=CFG):
    strategy = get_strategy(strategy_name)
    mesh = strategy.make_mesh(shape=shape, devices=devices)
    with jax.set_mesh(mesh):
        model = create_model(cfg, strategy, rngs=nnx.Rngs(seed))
        optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    return mesh, model, optimizer


def data_iter():
    return iter(grain.MapDataset.range(1000).shuffle(seed=3).to_iter_dataset())


def take_optimizer_step(mesh, model, optimizer):
    """One real AdamW step, so params and both moments differ from any fresh init."""
    with jax.set_mesh(mesh):
        grads = jax.tree.map(lambda p: p * 0.5 + 0.01, nnx.state(model, nnx.Param))
        optimizer.update(model, grads)


def leaves(module, what=nnx.Param):
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(module, what))]


def restored_equal(directory: str, step: int, target, params, opt_state):
    """The model and optimizer `build(*target)` makes, restored from `directory`'s step, after
    checking that their parameters and optimizer state equal `params` / `opt_state` bit for
    bit; the model."""
    mesh, model, optimizer = build(*target, seed=5)
    ckpt = Checkpointer(directory, save_every=1, keep=1, run_info={})
    with jax.set_mesh(mesh):
        ckpt.restore(step, model=model, optimizer=optimizer, data_iter=data_iter())
    ckpt.close()
    for got, want in zip(leaves(model), params, strict=True):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(leaves(optimizer, nnx.optimizer.OptState), opt_state, strict=True):
        np.testing.assert_array_equal(got, want)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint at step 7 written under fsdp_tp on a (4, 2) mesh, and what it holds."""
    workdir = str(tmp_path_factory.mktemp("run"))
    mesh, model, optimizer = build("fsdp_tp", (4, 2))
    take_optimizer_step(mesh, model, optimizer)
    it = data_iter()
    for _ in range(5):
        next(it)
    ckpt = Checkpointer(workdir, save_every=1, keep=3, run_info={"strategy": "fsdp_tp"})
    assert ckpt.save(7, model=model, optimizer=optimizer, data_iter=it, meta={"seed": 11})
    ckpt.close()
    return dict(
        workdir=workdir,
        params=leaves(model),
        opt_state=leaves(optimizer, nnx.optimizer.OptState),
        next_item=next(it),
    )


@pytest.mark.parametrize(
    "strategy_name, shape, num_devices",
    [("dp", (8,), 8), ("fsdp", (2,), 2), ("dp", (1,), 1)],
)
def test_restore_onto_other_strategy_is_bit_identical(saved, strategy_name, shape, num_devices):
    mesh, model, optimizer = build(strategy_name, shape, jax.devices()[:num_devices], seed=5)
    assert not all(
        np.array_equal(a, b) for a, b in zip(leaves(model), saved["params"], strict=True)
    )
    shardings = [x.sharding for x in jax.tree.leaves(nnx.state(model, nnx.Param))]
    it = data_iter()
    ckpt = Checkpointer(saved["workdir"], save_every=1, keep=3, run_info={})
    assert ckpt.latest_step() == 7
    with jax.set_mesh(mesh):
        meta = ckpt.restore(7, model=model, optimizer=optimizer, data_iter=it)
    ckpt.close()
    assert meta["step"] == 7 and meta["seed"] == 11 and meta["run_info"]["strategy"] == "fsdp_tp"
    for got, want in zip(leaves(model), saved["params"], strict=True):
        np.testing.assert_array_equal(got, want)
    opt = leaves(optimizer, nnx.optimizer.OptState)
    for got, want in zip(opt, saved["opt_state"], strict=True):
        np.testing.assert_array_equal(got, want)
    assert int(optimizer.step[...]) == 1
    assert next(it) == saved["next_item"]  # the data order continues where it was saved
    # Restored arrays carry the target strategy's layouts, on the target's devices.
    restored = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert [x.sharding for x in restored] == shardings
    assert all(len(x.sharding.device_set) == num_devices for x in restored)


def test_restore_params_only_onto_one_device(saved):
    mesh, model, _ = build("dp", (1,), jax.devices()[:1], seed=9)
    with jax.set_mesh(mesh):
        assert restore_params(saved["workdir"], model) == 7
    for got, want in zip(leaves(model), saved["params"], strict=True):
        np.testing.assert_array_equal(got, want)
    assert read_meta(saved["workdir"])[1]["seed"] == 11


def test_async_save_is_a_snapshot(tmp_path):
    """Changing (or donating) the arrays right after save() returns does not reach the disk."""
    mesh, model, optimizer = build("fsdp_tp", (4, 2))
    before = leaves(model)
    ckpt = Checkpointer(str(tmp_path), save_every=1, keep=1, run_info={})
    ckpt.save(1, model=model, optimizer=optimizer, data_iter=data_iter())
    take_optimizer_step(mesh, model, optimizer)  # replaces every parameter while writing
    ckpt.wait()
    ckpt.close()
    with jax.set_mesh(mesh):
        restore_params(str(tmp_path), model)
    for got, want in zip(leaves(model), before, strict=True):
        np.testing.assert_array_equal(got, want)


def test_save_every_keep_and_force(tmp_path):
    mesh, model, optimizer = build("dp", (8,))
    it = data_iter()
    ckpt = Checkpointer(str(tmp_path), save_every=2, keep=2, run_info={})
    saved_steps = [
        s for s in range(1, 8) if ckpt.save(s, model=model, optimizer=optimizer, data_iter=it)
    ]
    assert saved_steps == [2, 4, 6]
    assert ckpt.save(7, model=model, optimizer=optimizer, data_iter=it, force=True)
    assert not ckpt.save(7, model=model, optimizer=optimizer, data_iter=it, force=True)
    ckpt.close()
    assert complete_steps(checkpoint_dir(str(tmp_path))) == [6, 7]


def _largest_data_file(step_dir):
    """The largest OCDBT data file of the params item (where the arrays' bytes are)."""
    paths = [
        os.path.join(root, name)
        for root, _, names in os.walk(os.path.join(step_dir, "params"))
        for name in names
    ]
    return max(paths, key=os.path.getsize)


def test_manifest_covers_every_file_orbax_committed(saved):
    # The one assumption about Orbax: once a save is committed (its step dir has its name),
    # nothing more is written into it, so the checksums written then cover every file.
    step_dir = os.path.join(checkpoint_dir(saved["workdir"]), "7")
    manifest = integrity.read_manifest(step_dir)
    on_disk = {
        os.path.relpath(os.path.join(root, name), step_dir)
        for root, _, names in os.walk(step_dir)
        for name in names
    }
    assert set(manifest["files"]) == on_disk - {integrity.MANIFEST}
    assert {path.split("/")[0] for path in manifest["files"]} >= set(ITEMS)
    assert integrity.verify(step_dir) is None


def test_incomplete_steps_are_skipped_and_set_aside(saved, tmp_path):
    workdir = str(tmp_path)
    directory = checkpoint_dir(workdir)
    shutil.copytree(checkpoint_dir(saved["workdir"]), directory)
    # A later step whose checksums were never written (killed right after Orbax's commit),
    # an empty step dir, and a save killed before Orbax renamed its temporary directory.
    shutil.copytree(os.path.join(directory, "7"), os.path.join(directory, "9"))
    os.remove(os.path.join(directory, "9", integrity.MANIFEST))
    os.makedirs(os.path.join(directory, "8"))
    shutil.copytree(
        os.path.join(directory, "7"), os.path.join(directory, "10.orbax-checkpoint-tmp-1")
    )
    assert complete_steps(directory) == [7]
    mesh, model, optimizer = build("dp", (8,), seed=4)
    with jax.set_mesh(mesh):
        assert restore_params(workdir, model) == 7  # readers skip; nothing is moved
        with pytest.raises(ValueError, match=r"step|incomplete: no checksums.json"):
            restore_params(workdir, model, step=9)
    assert os.path.isdir(os.path.join(directory, "9"))
    ckpt = Checkpointer(workdir, save_every=1, keep=5, run_info={})
    assert ckpt.latest_step() == 7
    set_aside = sorted(n.split("-")[0] for n in os.listdir(os.path.join(directory, INVALID_SUBDIR)))
    assert set_aside == ["8", "9"]
    # The damaged step numbers can be saved again by the resumed run.
    assert ckpt.save(9, model=model, optimizer=optimizer, data_iter=data_iter())
    ckpt.close()
    assert complete_steps(directory) == [7, 9]


@pytest.mark.parametrize("damage", ["overwrite", "truncate"])
def test_damaged_latest_fails_in_eval_and_training_falls_back(saved, tmp_path, damage):
    workdir = str(tmp_path)
    directory = checkpoint_dir(workdir)
    shutil.copytree(checkpoint_dir(saved["workdir"]), directory)
    shutil.copytree(os.path.join(directory, "7"), os.path.join(directory, "9"))
    path = _largest_data_file(os.path.join(directory, "9"))
    with open(path, "r+b") as f:
        if damage == "overwrite":  # 4 bytes in the middle: a loader would read other numbers
            f.seek(os.path.getsize(path) // 2)
            f.write(b"\xde\xad\xbe\xef")
        else:
            f.truncate(os.path.getsize(path) // 2)
    mesh, model, optimizer = build("dp", (8,), seed=4)
    with jax.set_mesh(mesh), pytest.raises(CorruptCheckpointError) as info:
        restore_params(workdir, model)
    message = str(info.value)
    assert "\n" not in message
    assert f"{directory}/9 fails its integrity check: params/" in message
    assert "--step (steps: [7])" in message
    ckpt = Checkpointer(workdir, save_every=1, keep=5, run_info={})
    assert ckpt.latest_good_step() == 7
    assert os.listdir(os.path.join(directory, INVALID_SUBDIR))[0].startswith("9-")
    with jax.set_mesh(mesh):
        ckpt.restore(7, model=model, optimizer=optimizer)
    # The step set aside can be saved again by the resumed run.
    assert ckpt.save(9, model=model, optimizer=optimizer, data_iter=data_iter())
    ckpt.close()
    assert complete_steps(directory) == [7, 9]
    for got, want in zip(leaves(model), saved["params"], strict=True):
        np.testing.assert_array_equal(got, want)


def test_mismatching_config_names_the_arrays(saved):
    cfg = CFG.replace(ffn_dim=256)
    mesh, model, _ = build("dp", (8,), cfg=cfg)
    with jax.set_mesh(mesh), pytest.raises(ValueError) as info:
        restore_params(saved["workdir"], model)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("checkpoint does not fit the model: ")
    assert "blocks/mlp/up/weight saved (2, 64, 128) vs model (2, 64, 256)" in message
    assert "blocks/mlp/down/weight saved (2, 128, 64) vs model (2, 256, 64)" in message
    assert "attention" not in message  # only the arrays that differ


def test_no_checkpoint_is_a_usage_error(tmp_path):
    mesh, model, _ = build("dp", (8,))
    with jax.set_mesh(mesh), pytest.raises(UsageError, match="no complete checkpoint"):
        restore_params(str(tmp_path), model)
    with pytest.raises(UsageError, match="no complete checkpoint"):
        read_meta(str(tmp_path))


def test_preemption_watcher_sets_flag_on_signal():
    previous = signal.getsignal(signal.SIGTERM)
    watcher = PreemptionWatcher(check_every=2)
    try:
        assert not watcher.should_stop(1) and not watcher.should_stop(2)
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs before kill returns here
        assert watcher.requested
        assert not watcher.should_stop(3)  # only checked at multiples of check_every
        assert watcher.should_stop(4) and watcher.should_stop(5)  # and it stays stopped
    finally:
        watcher.close()
    assert signal.getsignal(signal.SIGTERM) is previous
