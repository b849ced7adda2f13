"""One training stream for every process count: n processes keep rows [p*B/n, (p+1)*B/n) of
the one-process batches, the saved position is the same on every process, and it resumes on
another process count (2 -> 1, 1 -> 2, 2 -> 4 -> 1) with the global batches of an
uninterrupted run, so no document is skipped or repeated. Through the data API with explicit
process_index / process_count (the real two-process runs are in test_multiprocess.py); the
worker count is checked in test_data.py (worker processes need a subprocess); checkpoints of
the earlier per-process format at the end.
"""

import json
import os
import shutil

import grain
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from nnx_zoo import data
from nnx_zoo.checkpoint import integrity
from nnx_zoo.checkpoint.manager import Checkpointer
from nnx_zoo.checkpoint.steps import checkpoint_dir
from nnx_zoo.data.position import documents_read, for_workers
from nnx_zoo.data.tokenizers import ByteTokenizer

BYTE = ByteTokenizer()
SEQ_LEN, BATCH = 32, 8


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """300 distinct short documents: many per batch, so positions move past documents."""
    rng = np.random.default_rng(0)
    texts = [f"doc {i}: " + "abcdefgh"[: i % 8] * int(rng.integers(1, 9)) for i in range(300)]
    path = tmp_path_factory.mktemp("elastic") / "docs.txt"
    path.write_text("\n\n".join(texts) + "\n", encoding="utf-8")
    return str(path)


def _processes(source, n, *, train=True, **kw):
    """One iterator per process of an n-process run (a small shuffle window, so the window
    state is part of the positions checked)."""
    stream = dict(shuffle=True, repeat=True, seed=3, shuffle_window=16) if train else {}
    return [
        data.make_dataset(
            source, "all", BYTE, SEQ_LEN, BATCH, process_index=p, process_count=n, **stream, **kw
        )
        for p in range(n)
    ]


def _global_batch(iterators):
    local = [next(it) for it in iterators]
    assert all(b["tokens"].shape == (BATCH // len(iterators), SEQ_LEN) for b in local)
    return {k: np.concatenate([b[k] for b in local]) for k in local[0]}


def _same(got, want):
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def _state(iterators):
    """The position every process saves: one, the same on all of them."""
    states = [json.loads(json.dumps(it.get_state())) for it in iterators]
    assert all(s == states[0] for s in states[1:])
    return states[0]


def test_process_rows_make_the_one_process_batches(source):
    one = _processes(source, 1)
    many = {n: _processes(source, n) for n in (2, 4)}
    for _ in range(6):
        want = _global_batch(one)
        for iterators in many.values():
            _same(_global_batch(iterators), want)
    # The same position on every process of every count, past dozens of documents.
    state = _state(one)
    assert all(_state(iterators) == state for iterators in many.values())
    assert documents_read(state) > 2 * BATCH
    # A single pass (validation): the short last batch is padded, then split, the same way.
    one, two = _processes(source, 1, train=False), _processes(source, 2, train=False)
    passes = 0
    for want in one[0]:
        _same(_global_batch(two), want)
        passes += 1
    assert passes > 1 and (want["segment_ids"] == 0).all(axis=1).any()  # a padded row
    with pytest.raises(StopIteration):
        _global_batch(two)


@pytest.mark.parametrize("counts", [(2, 1), (1, 2), (2, 4, 1)])
def test_resume_on_another_process_count_continues_the_global_stream(source, counts):
    steps_each = 4
    reference = _processes(source, 1)
    want = [_global_batch(reference) for _ in range(steps_each * len(counts))]
    got, state = [], None
    for n in counts:
        iterators = _processes(source, n)
        if state is not None:
            for it in iterators:
                it.set_state(state)
        got += [_global_batch(iterators) for _ in range(steps_each)]
        state = _state(iterators)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert np.array_equal(g["tokens"], w["tokens"]), f"global batch {step + 1} differs"
        _same(g, w)
    assert state == _state(reference)  # the same position as the uninterrupted run's


# ----------------------------------------------------------------------------- checkpoints


class _Tiny(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.arange(16.0).reshape(4, 4))


def _saved_checkpoint(workdir, iterator):
    model = _Tiny()
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    ckpt = Checkpointer(workdir, save_every=1, keep=1, run_info={})
    assert ckpt.save(1, model=model, optimizer=optimizer, data_iter=iterator)
    ckpt.close()
    return os.path.join(checkpoint_dir(workdir), "1")


def _restore(workdir, iterator):
    model = _Tiny()
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    ckpt = Checkpointer(workdir, save_every=1, keep=1, run_info={})
    try:
        ckpt.restore(1, model=model, optimizer=optimizer, data_iter=iterator)
    finally:
        ckpt.close()


def _as_per_process_format(step_dir, states):
    """Rewrite `step_dir` as earlier versions wrote it: no `data_position`, and a `data` item
    of Grain's per-process files (grain.checkpoint's names), its checksums written again."""
    shutil.rmtree(os.path.join(step_dir, "data_position"))
    os.makedirs(os.path.join(step_dir, "data"))
    for i, state in enumerate(states):
        with open(os.path.join(step_dir, "data", f"process_{i}-of-{len(states)}.json"), "w") as f:
            json.dump(state, f)
    open(os.path.join(step_dir, "data", "commit_success.txt"), "w").close()
    path = os.path.join(step_dir, "_CHECKPOINT_METADATA")
    with open(path) as f:
        metadata = json.load(f)
    handlers = metadata["item_handlers"]
    del handlers["data_position"]
    handlers["data"] = f"{grain.checkpoint.CheckpointHandler.__module__}.CheckpointHandler"
    with open(path, "w") as f:
        json.dump(metadata, f)
    integrity.write_manifest(step_dir)


def test_checkpoint_keeps_one_global_position_and_reads_the_per_process_format(source, tmp_path):
    reference = _processes(source, 1)
    for _ in range(5):
        next(reference[0])
    raw = for_workers(_state(reference), 0)  # Grain's own state: what earlier versions saved
    two = _processes(source, 2)
    for _ in range(5):
        _global_batch(two)
    step_dir = _saved_checkpoint(str(tmp_path / "new"), two[0])
    # Once, in the global form, whatever wrote it.
    assert not os.path.exists(os.path.join(step_dir, "data"))
    with open(os.path.join(step_dir, "data_position", "metadata")) as f:
        assert json.load(f) == _state(reference)
    want = [next(reference[0]) for _ in range(3)]

    def resumed_batches(workdir, n):
        iterators = _processes(source, n)
        for it in iterators:
            _restore(workdir, it)
        return [_global_batch(iterators) for _ in range(3)]

    for got, w in zip(resumed_batches(str(tmp_path / "new"), 1), want, strict=True):
        _same(got, w)
    # A one-process checkpoint of the earlier format is a position in the global stream.
    legacy = str(tmp_path / "legacy")
    _as_per_process_format(_saved_checkpoint(legacy, two[0]), [raw])
    for got, w in zip(resumed_batches(legacy, 2), want, strict=True):
        _same(got, w)
    # Several processes of the earlier format: positions in per-process streams, refused.
    _as_per_process_format(_saved_checkpoint(str(tmp_path / "two"), two[0]), [raw, raw])
    with pytest.raises(ValueError) as error:
        _restore(str(tmp_path / "two"), _processes(source, 1)[0])
    (line,) = str(error.value).splitlines()
    assert "keeps one data position per process (process_0-of-2.json, process_1-of-2.json)" in line
    assert "resume it with the version that wrote it, or change a data field" in line


def test_only_a_changed_stream_restarts_it():
    from _train_helpers import run_config

    from nnx_zoo.launch.resume import data_changes

    saved = run_config({"data.num_workers": 2})
    # Workers (and the process count, which no config holds) leave the position valid.
    assert data_changes(run_config({"data.num_workers": 0}), saved) == []
    changed = run_config({"data.num_workers": 0, "data.seq_len": 32, "data.shuffle_seed": 4})
    assert data_changes(changed, saved) == [
        "data.shuffle_seed 0 -> 4",
        f"data.seq_len {saved.data.seq_len} -> 32",
    ]
