"""eval_main.py: a checkpoint saved under fsdp_tp on (4, 2) evaluates to the same loss under
dp on 8 devices (in this process) and on one device (a process of one device), equal to the
in-process loss of the saved model; generation from the one-device run equals the in-process
one; bad input exits 2."""

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys

import _entry
import jax
import numpy as np
import optax
import pytest
from _stderr import ours
from _train_helpers import child_env
from flax import nnx
from model_utils import save_as_run

import configs.tiny
from nnx_zoo import data
from nnx_zoo.checkpoint.steps import checkpoint_dir
from nnx_zoo.data.tokenizers import make_tokenizer
from nnx_zoo.evaluation.metrics import json_safe
from nnx_zoo.training.config import RunConfig
from shardings import get_strategy
from zoo import create_model
from zoo.generate import generate
from zoo.loss import token_nll

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EVAL_BATCHES = 2
PROMPT = "def main("
# Both sides sum float32 NLLs of ~1000 tokens after matmuls split differently over devices
# (8-way batch split vs one device vs the in-process (4, 2) mesh); each partial sum is exact
# to ~1e-7 relative, and the sums differ only in reduction order: 1e-5 relative bounds it.
RTOL = 1e-5


def run_config():
    c = configs.tiny.get_config()
    c.model.hidden_dim, c.model.num_layers, c.model.ffn_dim = 64, 2, 128
    c.data.seq_len, c.data.global_batch_size = 64, 8
    c.training.eval_batches = EVAL_BATCHES
    return RunConfig.from_config_dict(c)


def eval_main(workdir, *flags):
    """eval_main in this process (tests/_entry.py), on its 8 devices."""
    return _entry.evaluate([f"--workdir={workdir}", *flags])


def eval_main_process(workdir, *flags, num_devices=8):
    """eval_main as a process of `num_devices` devices: what a host of that many sees, and the
    entry point's own stderr and exit status."""
    env = child_env(num_devices)
    return subprocess.run(
        [sys.executable, "eval_main.py", f"--workdir={workdir}", *flags],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A perturbed tiny model saved under fsdp_tp on (4, 2), and its in-process loss on the
    validation batches eval_main reads."""
    workdir = str(tmp_path_factory.mktemp("eval"))
    run = run_config()
    cfg = run.model.decoder_config()
    strategy = get_strategy("fsdp_tp")
    mesh = strategy.make_mesh(shape=(4, 2))
    with jax.set_mesh(mesh):
        model = create_model(cfg, strategy, rngs=nnx.Rngs(0))
        # Move every parameter away from the seed-0 init eval_main could otherwise rebuild.
        params = nnx.state(model, nnx.Param)
        keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(params))))
        nnx.update(
            model,
            jax.tree.map(
                lambda p: (
                    p + 0.05 * jax.random.normal(next(keys), p.shape, out_sharding=p.sharding)
                ),
                params,
            ),
        )
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    save_as_run(workdir, run, mesh, model, optimizer)
    tokenizer = make_tokenizer(run.data.tokenizer)

    val = data.build_dataset(
        run.data.source,
        "validation",
        tokenizer,
        run.data.seq_len,
        run.data.global_batch_size,
        num_batches=EVAL_BATCHES,
    )
    total, count = 0.0, 0
    sharding = jax.sharding.NamedSharding(mesh, strategy.batch_spec())
    with jax.set_mesh(mesh):
        for batch in val:
            batch = {k: jax.device_put(v, sharding) for k, v in batch.items()}
            logits = model(
                batch["tokens"], segment_ids=batch["segment_ids"], positions=batch["positions"]
            )
            nll, mask = token_nll(logits, batch["tokens"], batch["segment_ids"])
            total += float(np.asarray(nll).sum())
            count += int(np.asarray(mask).sum())
        generated = generate(
            model,
            [tokenizer.encode(PROMPT)],
            max_new_tokens=12,
            eos_id=tokenizer.eos_id,
        )[0]
    return dict(
        workdir=workdir,
        loss=total / count,
        tokens=count,
        generated=tokenizer.decode(generated),
        saving=(run, mesh, model, optimizer),
    )


def test_same_loss_on_any_strategy_and_device_count(saved):
    workdir = saved["workdir"]
    results = {}
    for name, flags, devices in (
        # Full logits and a named backend: the same loss as the run's chunked default.
        ("dp8", ["--sharding_strategy=dp", "--loss_chunk_size=0", "--attention_impl=xla"], 8),
        ("one", ["--sharding_strategy=dp", f"--prompt={PROMPT}", "--max_new_tokens=12"], 1),
    ):
        if devices == 8:
            proc = eval_main(workdir, *flags)
        else:
            proc = eval_main_process(workdir, *flags, num_devices=devices)
        assert proc.returncode == 0, proc.stderr[-3000:]
        with open(os.path.join(workdir, "eval.json")) as f:
            results[name] = json.load(f)
    dp8, one = results["dp8"], results["one"]
    assert dp8["mesh_shape"] == {"data": 8} and one["mesh_shape"] == {"data": 1}
    assert dp8["step"] == one["step"] == 3
    assert dp8["tokens"] == one["tokens"] == saved["tokens"]
    np.testing.assert_allclose(dp8["loss"], saved["loss"], rtol=RTOL)
    np.testing.assert_allclose(one["loss"], saved["loss"], rtol=RTOL)
    np.testing.assert_allclose(one["perplexity"], np.exp(one["loss"]), rtol=1e-12)
    # Byte tokenizer: every predicted id is one byte, except EOS (zero bytes).
    assert 0 < one["bytes"] <= one["tokens"]
    np.testing.assert_allclose(
        one["bits_per_byte"], one["loss"] * one["tokens"] / np.log(2) / one["bytes"], rtol=1e-12
    )
    assert one["generated"] == saved["generated"]
    assert not [n for n in os.listdir(workdir) if n.startswith(".tmp-")]  # written atomically


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--sharding_strategy=zero"], "unknown sharding strategy 'zero'"),
        (["--mesh_shape=data:3"], "needs 3 devices but 8 are available"),
        (["--step=99"], "no checkpoint for step 99"),
        (["--data=/nonexistent/x.txt"], "does not exist"),
        (["--attention_impl=cudnn"], "'cudnn' needs an NVIDIA GPU"),
        (["--loss_chunk_size=-1"], "--loss_chunk_size=-1 must be >= 0"),
    ],
)
def test_bad_input_exits_2_with_one_line(saved, flags, message):
    proc = eval_main(saved["workdir"], "--sharding_strategy=dp", *flags)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr


def test_empty_workdir_exits_2(tmp_path):
    proc = eval_main_process(str(tmp_path))
    assert proc.returncode == 2
    assert ours(proc.stderr).strip().startswith("error: no complete checkpoint in"), proc.stderr


def test_workdir_that_is_a_file_exits_2_before_any_work(tmp_path):
    path = tmp_path / "a-file"
    path.write_text("")
    proc = eval_main(str(path))
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: --workdir={path} is a file, not a directory"


def test_damaged_checkpoint_is_named_and_another_step_can_be_chosen(saved, tmp_path):
    workdir = str(tmp_path)
    directory = checkpoint_dir(workdir)
    shutil.copytree(checkpoint_dir(saved["workdir"]), directory)
    shutil.copytree(os.path.join(directory, "3"), os.path.join(directory, "5"))
    params = os.path.join(directory, "5", "params")
    paths = [os.path.join(r, n) for r, _, names in os.walk(params) for n in names]
    largest = max(paths, key=os.path.getsize)
    with open(largest, "r+b") as f:  # 4 bytes overwritten in the arrays' data
        f.seek(os.path.getsize(largest) // 2)
        f.write(b"\x00\xff\x00\xff")
    proc = eval_main(workdir, "--sharding_strategy=dp")
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert f"{directory}/5 fails its integrity check: params/" in lines[0]
    assert "--step (steps: [3])" in lines[0]
    # The step it names works, and generation alone neither evaluates nor writes eval.json.
    proc = eval_main(
        workdir, "--step=3", "--noevaluate", f"--prompt={PROMPT}", "--max_new_tokens=12"
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.endswith(f"{PROMPT}{saved['generated']}\n"), proc.stdout
    assert "loss" not in proc.stdout
    assert not os.path.exists(os.path.join(workdir, "eval.json"))


def test_non_finite_results_are_null_and_flagged():
    metrics = {"loss": math.nan, "perplexity": math.inf, "bits_per_byte": None, "tokens": 5}
    safe = json_safe(metrics)
    assert safe == {
        "loss": None,
        "perplexity": None,
        "bits_per_byte": None,
        "tokens": 5,
        "non_finite": ["loss", "perplexity"],
    }
    json.dumps(safe, allow_nan=False)  # strict JSON


def test_a_run_trained_on_a_named_backend_generates_on_auto(saved, tmp_path):
    # A GPU run's record says cudnn; this host has no GPU, and KV-cache decoding is a call
    # cudnn cannot express. Only a backend named to eval_main binds it.
    workdir = str(tmp_path)
    run, mesh, model, optimizer = saved["saving"]
    on_gpu = dataclasses.replace(run, model=dataclasses.replace(run.model, attention_impl="cudnn"))
    save_as_run(workdir, on_gpu, mesh, model, optimizer)
    proc = eval_main(workdir, "--noevaluate", f"--prompt={PROMPT}", "--max_new_tokens=12")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.endswith(f"{PROMPT}{saved['generated']}\n"), proc.stdout
    named = eval_main(workdir, "--noevaluate", f"--prompt={PROMPT}", "--attention_impl=cudnn")
    assert named.returncode == 2 and "'cudnn' needs an NVIDIA GPU" in named.stderr, named.stderr
