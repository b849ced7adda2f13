"""A vocabulary that does not divide its split over `model` (GPT-2's 50257 under tp): the
table is padded to a multiple of 128 x the vocab shards, the padding's logits are masked, and
every number is the unpadded model's.

The models here have V = 509 (a prime: no mesh axis divides it). The padded rows are filled
with large values before each comparison, so a logit that escaped the mask would win every
softmax and argmax: the tests fail if the mask is missing anywhere (loss, gradients,
generation). Tolerances as in test_strategies_equal_one_device.py (float32; split
contractions sum in another order): 2e-5 on logits and losses, 1e-5 + 1e-4 relative on
gradients.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import grain
import jax
import numpy as np
import optax
import pytest
from flax import nnx
from model_utils import host_params, load_params, packed_batch, put_batch

from nnx_zoo.checkpoint.manager import Checkpointer
from nnx_zoo.checkpoint.restore import restore_params
from shardings import get_strategy
from zoo import create_model, get_config
from zoo.build import fit_vocab, model_class
from zoo.generate import generate
from zoo.gpt2.modeling import GPT2Config
from zoo.hf_io import from_pretrained, save_pretrained

V = 509
MODELS = {
    # Tied head: the embedding table [V, M] is also the LM head.
    "gpt2": GPT2Config(
        vocab_size=V,
        hidden_dim=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=4,
        head_dim=16,
        ffn_dim=128,
        max_seq_len=64,
    ),
    # Untied: an LM head [M, V] besides the table.
    "llama": get_config("tiny").replace(vocab_size=V),
}
# (model, strategy, mesh shape, padded rows): 509 rounds up to 128 x the vocab shards
# (model=2 -> 256, model=4 -> 512): 512 rows either way.
SPLIT = [("gpt2", "fsdp_tp", (4, 2), 512), ("llama", "tp", (2, 4), 512)]


def _model(cfg, strategy_name, shape, devices=None, seed=0):
    strategy = get_strategy(strategy_name)
    mesh = strategy.make_mesh(shape=shape, devices=devices, config=cfg)
    with jax.set_mesh(mesh):
        model = create_model(cfg, strategy, rngs=nnx.Rngs(seed))
    return strategy, mesh, model


@functools.cache
def _reference(name):
    """The unpadded model on one device: its params, logits, loss and gradients."""
    cfg = MODELS[name]
    strategy, mesh, model = _model(cfg, "dp", (1,), jax.devices()[:1])
    assert model.cfg.vocab_rows == V
    batch = packed_batch(batch=8, seq=32, vocab=V, seed=3)
    with jax.set_mesh(mesh):
        out = _loss_grads_logits(model, put_batch(batch, strategy.lm_sharding().tokens))
    return dict(name=name, cfg=cfg, params=host_params(model), batch=batch, out=out)


def _mean_nll(model, batch, chunk_size):
    nll, mask, _ = model.token_nll(
        batch["tokens"],
        segment_ids=batch["segment_ids"],
        positions=batch["positions"],
        chunk_size=chunk_size,
    )
    return nll.sum() / mask.sum()


@functools.partial(nnx.jit, static_argnums=2)
def _loss_and_grads(model, batch, chunk_size):
    return nnx.value_and_grad(lambda m: _mean_nll(m, batch, chunk_size))(model)


@nnx.jit
def _logits(model, batch):
    return model(batch["tokens"], segment_ids=batch["segment_ids"], positions=batch["positions"])


def _loss_grads_logits(model, batch):
    # Jitted: op by op, the sharded model took 65-105 s per case on 2 cores.
    out = {"logits": np.asarray(_logits(model, batch))}
    for chunk_size in (0, 64):
        loss, grads = _loss_and_grads(model, batch, chunk_size)
        out[f"loss{chunk_size}"] = float(loss)
        out[f"grads{chunk_size}"] = {
            "/".join(map(str, p)): np.asarray(jax.device_get(v[...]))
            for p, v in nnx.to_flat_state(grads)
        }
    return out


def _padded_params(params, cfg, rows, seed=0):
    """The reference params with the vocab padded to `rows`, the padding large (a logit that
    escaped the mask would dominate)."""
    rng = np.random.default_rng(seed)
    out = dict(params)
    for key, dim in (("embed/table", 0), ("lm_head/weight", 1)):
        if key in out:
            w = out[key]
            pad_shape = list(w.shape)
            pad_shape[dim] = rows - w.shape[dim]
            out[key] = np.concatenate(
                [w, 50.0 * np.abs(rng.standard_normal(pad_shape)).astype(w.dtype)], axis=dim
            )
    return out


def _true_rows(key, w):
    if key.endswith("embed/table"):
        return w[:V]
    if key.endswith("lm_head/weight"):
        return w[:, :V]
    return w


@pytest.mark.parametrize("name, strategy_name, shape, rows", SPLIT)
def test_padded_model_equals_unpadded_one_device(name, strategy_name, shape, rows):
    reference = _reference(name)
    cfg = reference["cfg"]
    strategy, mesh, model = _model(cfg, strategy_name, shape)
    assert model.cfg.padded_vocab_size == rows and model.cfg.vocab_size == V
    assert model.embed.table[...].shape[0] == rows
    # Each shard's slice of the head is a multiple of 128 columns.
    assert rows % (128 * mesh.shape["model"]) == 0
    load_params(model, _padded_params(reference["params"], cfg, rows))
    with jax.set_mesh(mesh):
        out = _loss_grads_logits(model, put_batch(reference["batch"], strategy.batch_spec()))
    want = reference["out"]
    assert out["logits"].shape == want["logits"].shape == (8, 32, V)
    np.testing.assert_allclose(out["logits"], want["logits"], atol=2e-5)
    for chunk_size in (0, 64):
        np.testing.assert_allclose(out[f"loss{chunk_size}"], want["loss0"], atol=2e-5)
        grads = out[f"grads{chunk_size}"]
        for key, g in grads.items():
            np.testing.assert_allclose(
                _true_rows(key, g), want["grads0"][key], rtol=1e-4, atol=1e-5, err_msg=key
            )
        # No gradient reaches the padding: it is never looked up and its logits are masked.
        for key, dim in (("embed/table", 0), ("lm_head/weight", 1)):
            if key in grads:
                padding = np.take(grads[key], np.arange(V, rows), axis=dim)
                assert not padding.any(), key


@pytest.mark.parametrize("name, strategy_name, shape, rows", SPLIT[:1])
def test_generation_never_picks_a_padding_id(name, strategy_name, shape, rows):
    reference = _reference(name)
    cfg = reference["cfg"]
    prompts = [[5, 17, 3, 250], [508, 1, 2]]
    _, ref_mesh, ref_model = _model(cfg, "dp", (1,), jax.devices()[:1])
    load_params(ref_model, reference["params"])
    with jax.set_mesh(ref_mesh):
        want = generate(ref_model, prompts, max_new_tokens=8)
    _, mesh, model = _model(cfg, strategy_name, shape)
    load_params(model, _padded_params(reference["params"], cfg, model.cfg.vocab_rows))
    with jax.set_mesh(mesh):
        greedy = generate(model, prompts, max_new_tokens=8)
        sampled = generate(model, prompts, max_new_tokens=8, temperature=1.0, top_k=5, seed=1)
    assert greedy == want
    assert all(0 <= t < V for row in greedy + sampled for t in row)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_hf_files_hold_the_true_vocab(name, tmp_path):
    """Export from a padded model writes V rows; import pads again under a split, or not."""
    reference = _reference(name)
    cfg = reference["cfg"]
    _, mesh, model = _model(cfg, "fsdp_tp", (4, 2))
    load_params(model, _padded_params(reference["params"], cfg, model.cfg.vocab_rows))
    path = str(tmp_path / "hf")
    with jax.set_mesh(mesh):
        save_pretrained(model, path)
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["vocab_size"] == V
    with open(os.path.join(path, "model.safetensors"), "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    table = next(v for k, v in header.items() if k.endswith(("wte.weight", "embed_tokens.weight")))
    assert table["shape"][0] == V
    for name, shape, devices in (("fsdp_tp", (4, 2), None), ("dp", (1,), jax.devices()[:1])):
        strategy = get_strategy(name)
        mesh = strategy.make_mesh(shape=shape, devices=devices, config=cfg)
        with jax.set_mesh(mesh):
            loaded = from_pretrained(path, strategy)
        assert loaded.cfg.vocab_rows == (512 if name == "fsdp_tp" else V)
        for key, w in host_params(loaded).items():
            np.testing.assert_array_equal(_true_rows(key, w), reference["params"][key], key)
            if loaded.cfg.vocab_rows > V and key in ("embed/table", "lm_head/weight"):
                assert not np.take(w, np.arange(V, 512), axis=0 if "embed" in key else 1).any()


def _save(workdir, model, cfg):
    """A training checkpoint of `model` (and fresh AdamW state), recording its config as a
    run does."""
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    run_info = {"model_config": {"type": type(cfg).__name__, **dataclasses.asdict(model.cfg)}}
    ckpt = Checkpointer(workdir, save_every=1, keep=1, run_info=run_info, async_save=False)
    data = iter(grain.MapDataset.range(10).to_iter_dataset())
    assert ckpt.save(3, model=model, optimizer=optimizer, data_iter=data)
    ckpt.close()


# The untied model: its LM head [M, V] and its AdamW moments are resized too.
@pytest.mark.parametrize("direction", ["padded_to_unpadded", "unpadded_to_padded"])
def test_checkpoint_restores_across_paddings(tmp_path, direction):
    """A run's checkpoint loads onto a mesh that pads the vocab otherwise: rows are cut or
    zero-padded, and the true ones are the saved ones."""
    reference = _reference("llama")
    cfg = reference["cfg"]
    split = ("fsdp_tp", (4, 2), None)
    whole = ("fsdp", (8,), None)  # fsdp leaves V whole: no padding
    src, dst = (split, whole) if direction == "padded_to_unpadded" else (whole, split)
    _, mesh, model = _model(cfg, *src)
    load_params(model, _padded_params(reference["params"], cfg, model.cfg.vocab_rows))
    workdir = str(tmp_path)
    with jax.set_mesh(mesh):
        _save(workdir, model, cfg)
    strategy = get_strategy(dst[0])
    mesh = strategy.make_mesh(shape=dst[1], config=cfg)
    target_cfg = fit_vocab(model.cfg if direction == "padded_to_unpadded" else cfg, strategy, mesh)
    if direction == "padded_to_unpadded":
        # A saved padding that divides the new split is kept: fsdp does not split V at all.
        assert target_cfg.vocab_rows == 512
        target_cfg = cfg  # an unpadded model, as a config without the run's padding gives
    with jax.set_mesh(mesh):
        target = nnx.eval_shape(
            lambda: model_class(target_cfg)(target_cfg, strategy.lm_sharding(), rngs=nnx.Rngs(0))
        )
        assert restore_params(workdir, target) == 3
    rows = target.cfg.vocab_rows
    for key, w in host_params(target).items():
        np.testing.assert_array_equal(_true_rows(key, w), reference["params"][key], key)
        if rows > V and key in ("embed/table", "lm_head/weight"):
            assert not np.take(w, np.arange(V, rows), axis=0 if "embed" in key else 1).any()


def test_checkpoint_of_another_vocabulary_is_refused(tmp_path):
    cfg = MODELS["gpt2"]
    _, mesh, model = _model(cfg, "fsdp", (8,))
    with jax.set_mesh(mesh):
        _save(str(tmp_path), model, cfg)
    other = cfg.replace(vocab_size=V + 3)
    strategy = get_strategy("fsdp")
    with jax.set_mesh(mesh):
        target = nnx.eval_shape(
            lambda: model_class(other)(other, strategy.lm_sharding(), rngs=nnx.Rngs(0))
        )
        refused = r"embed/table saved \(509, \d+\) vs model \(512, \d+\)"
        with pytest.raises(ValueError, match=refused):
            restore_params(str(tmp_path), target)
