"""Weighted mixtures (`data.mixture`, nnx_zoo/data/mixture.py): the config string and its
one-line errors; each source's share of rows against its weight; whole rows from one source;
identical batches after a resume at any step and on another process count; a weight change
on resume (each source continues, the new shares from the resume on); random-access sources
read by each process for its own rows only, token stores among them (a store and a text file,
two stores); the worker count (a subprocess); train_main's
`tokens/<name>` against the batches' own counts, its resume rules, and eval_main's val_loss.
"""

import json
import os
import textwrap
import types

import grain
import numpy as np
import pytest
from _train_helpers import QUIET_LOGS, SMALL_SHAPES, cli_flags, run_train_main

from nnx_zoo.data import rows as store_rows_module
from nnx_zoo.data import token_store
from nnx_zoo.data.mixture import (
    SOURCE_IDS,
    Mixture,
    MixtureSource,
    make_mixture,
    proportions,
    rows_before,
    source_of_row,
)
from nnx_zoo.data.tokenize_corpus import Request, tokenize_corpus
from nnx_zoo.data.tokenizers import ByteTokenizer
from nnx_zoo.training import loop
from nnx_zoo.training.config import DataSection
from nnx_zoo.training.mixture_spec import parse_mixture

BYTE = ByteTokenizer()
# Source a writes only 'x' after its label, source b only 'y': a row's bytes say its source.
X, Y = ord("x"), ord("y")


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mixture")
    paths = {}
    for name, letter in (("a", "x"), ("b", "y")):
        texts = [f"{name}{i} " + letter * (i % 13 + 1) for i in range(150)]
        paths[name] = str(folder / f"{name}.txt")
        with open(paths[name], "w", encoding="utf-8") as f:
            f.write("\n\n".join(texts) + "\n")
    return paths


@pytest.fixture(scope="module")
def stores(sources, tmp_path_factory):
    """Each text source tokenized by zoo-data (bytes) into a store of 3 shards."""
    folder = tmp_path_factory.mktemp("mixture_stores")
    out = {}
    for name, path in sources.items():
        out[name] = str(folder / name)
        tokenize_corpus(Request(path, "byte", out[name], shard_bytes=700), log=lambda line: None)
        assert len(token_store.read_index(out[name])["shards"]) == 3
    return out


def _kinds(sources, stores, kind):
    """{a, b} sources of a mixture: text files, a store and a text file, or two stores."""
    return {
        "text": sources,
        "store_and_text": {"a": stores["a"], "b": sources["b"]},
        "two_stores": stores,
    }[kind]


def _components(sources, wa=0.7, wb=0.3):
    return parse_mixture(f"a:{sources['a']}:{wa},b:{sources['b']}:{wb}")


def _iterator(sources, wa=0.7, wb=0.3, *, seq_len=16, batch=8, p=0, n=1, split="train", **kw):
    return make_mixture(
        _components(sources, wa, wb),
        split,
        BYTE,
        seq_len,
        batch,
        seed=3,
        process_index=p,
        process_count=n,
        **kw,
    )


def _take(iterator, count):
    return [next(iterator) for _ in range(count)]


def _same(got, want):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.keys() == w.keys()
        for key in w:
            np.testing.assert_array_equal(g[key], w[key], err_msg=f"batch {i} {key}")


def _json(state):
    return json.loads(json.dumps(state))


# ----------------------------------------------------------------------------- config


def test_the_config_string_parses_and_normalizes():
    parts = DataSection(
        mixture=" code:gs://bucket/code/*.arrayrecord:7 , web:/d/web:3"
    ).mixture_components()
    assert [(c.name, c.source) for c in parts] == [
        ("code", "gs://bucket/code/*.arrayrecord"),  # a source may hold ':'
        ("web", "/d/web"),
    ]
    assert [c.weight for c in parts] == pytest.approx([0.7, 0.3])
    assert DataSection().mixture_components() == ()


@pytest.mark.parametrize(
    "mixture, source, message",
    [
        ("code:/data/code", "default", "'code:/data/code' is not name:source:weight; expected"),
        ("a:/x:1,", "default", "'' is not name:source:weight"),
        ("a:/x:0,b:/y:1", "default", "weight 0 of 'a' must be a finite number > 0"),
        ("a:/x:-2", "default", "weight -2 of 'a' must be a finite number > 0"),
        ("a:/x:nan", "default", "weight nan of 'a' must be a finite number > 0"),
        ("a:/x:heavy", "default", "weight 'heavy' of 'a' is not a number"),
        ("a:/x:1,a:/y:1", "default", "source name 'a' appears twice"),
        ("my web:/x:1", "default", "source name 'my web' in 'my web:/x:1': use letters"),
        ("a:/x:1", "/data/other", "data.source='/data/other': leave it at 'default'"),
    ],
)
def test_a_bad_mixture_is_one_line_naming_it(mixture, source, message):
    with pytest.raises(ValueError) as e:
        DataSection(mixture=mixture, source=source)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert str(e.value).startswith("config data.")


# ----------------------------------------------------------------------------- the schedule


def test_the_schedule_is_exact_and_random_access():
    rng = np.random.default_rng(0)
    for k in (2, 3, 5):
        weights = rng.random(k) + 0.05
        props = proportions(weights / weights.sum())
        counts = [0] * k
        for row in range(3000):  # the closed form agrees with counting row by row
            assert rows_before(row, props) == counts
            source, index = source_of_row(row, props)
            assert index == counts[source]
            counts[source] += 1
            share = np.array(counts) - (row + 1) * np.array(props) / sum(props)
            assert np.abs(share).max() < k


@pytest.mark.parametrize("kind", ["text", "store_and_text", "two_stores"])
def test_shares_within_one_percent_over_10000_rows(sources, stores, kind):
    """0.7 / 0.3 at seq_len 8: over 10,000 rows each source's share is within 1% of its
    weight (in fact within a row of it in every batch), and every row holds one source."""
    it = _iterator(_kinds(sources, stores, kind), seq_len=8, batch=16)
    batches = _take(it, 625)
    ids = np.concatenate([b[SOURCE_IDS] for b in batches])
    assert len(ids) == 10_000
    shares = np.bincount(ids, minlength=2) / len(ids)
    assert abs(shares[0] - 0.7) < 0.01 and abs(shares[1] - 0.3) < 0.01, shares
    for b in batches:
        assert 16 * 0.7 - 1 < np.sum(b[SOURCE_IDS] == 0) < 16 * 0.7 + 1
        tokens = b["tokens"]
        assert not (tokens[b[SOURCE_IDS] == 0] == Y).any()  # a's rows hold no byte of b
        assert not (tokens[b[SOURCE_IDS] == 1] == X).any()
        assert (tokens[b[SOURCE_IDS] == 0] == X).any() and (tokens[b[SOURCE_IDS] == 1] == Y).any()
    it.close()


# ----------------------------------------------------------------------------- resume


@pytest.mark.parametrize("kind", ["text", "store_and_text", "two_stores"])
def test_identical_batches_after_a_resume_at_any_step(sources, stores, kind):
    sources = _kinds(sources, stores, kind)
    want = _take(_iterator(sources), 12)
    for step in (0, 1, 5, 9):
        first = _iterator(sources)
        _take(first, step)
        state = _json(first.get_state())
        resumed = _iterator(sources)
        resumed.set_state(state)
        _same(_take(resumed, 12 - step), want[step:])


def test_the_position_is_global_and_resumes_on_another_process_count(sources):
    one = _iterator(sources)
    two = [_iterator(sources, p=p, n=2) for p in range(2)]
    for _ in range(4):
        whole = next(one)
        halves = [next(it) for it in two]
        for key in whole:
            np.testing.assert_array_equal(np.concatenate([h[key] for h in halves]), whole[key])
    state = _json(one.get_state())
    assert all(_json(it.get_state()) == state for it in two)  # one fact on every process
    want = _take(one, 3)
    four = [_iterator(sources, p=p, n=4) for p in range(4)]
    for it in four:
        it.set_state(state)
    for w in want:
        quarters = [next(it) for it in four]
        np.testing.assert_array_equal(np.concatenate([q["tokens"] for q in quarters]), w["tokens"])


def _rows_of(batches, source):
    return [row for b in batches for row in b["tokens"][b[SOURCE_IDS] == source]]


@pytest.mark.parametrize("kind", ["text", "store_and_text"])
def test_a_weight_change_continues_each_source_with_the_new_shares(sources, stores, kind):
    sources = _kinds(sources, stores, kind)
    before = _iterator(sources, 0.7, 0.3)
    old = _take(before, 5)
    state = _json(before.get_state())
    after = _iterator(sources, 0.5, 0.5)
    after.set_state(state)
    assert after.reweighted_at == 5 * 8
    new = _take(after, 30)
    # From the resume on, every prefix holds the new shares to within a row.
    counts = np.cumsum([np.bincount(b[SOURCE_IDS], minlength=2) for b in new], axis=0)
    rows = np.arange(1, len(new) + 1)[:, None] * 8
    assert np.abs(counts - rows * 0.5).max() <= 1
    # Each source continues its own stream where it was: its rows before and after are its
    # rows of an uninterrupted run.
    reference = _take(_iterator(sources, 0.7, 0.3), 60)
    for source in (0, 1):
        got = _rows_of(old, source) + _rows_of(new, source)
        np.testing.assert_array_equal(got, _rows_of(reference, source)[: len(got)])
    # Its state is global and saves the new schedule: a second resume changes nothing.
    again = _iterator(sources, 0.5, 0.5)
    again.set_state(_json(after.get_state()))
    assert again.reweighted_at is None
    _same(_take(again, 3), _take(after, 3))


def test_a_state_of_other_sources_is_refused_naming_both(sources):
    state = _json(_iterator(sources).get_state())
    other = make_mixture(
        parse_mixture(f"a:{sources['a']}:1,c:{sources['b']}:1"),
        "train",
        BYTE,
        16,
        8,
        seed=3,
        process_index=0,
        process_count=1,
    )
    with pytest.raises(
        ValueError, match=r"mixes the sources \['a', 'b'\], this stream \['a', 'c'\]"
    ):
        other.set_state(state)


# ----------------------------------------------------------------------------- random access


class _Reads:
    """Rows of a random-access source (what a pre-tokenized store gives): row i of source s
    is filled with 1000 * s + i; every index read is recorded."""

    def __init__(self, source):
        self.source, self.read = source, []

    def __call__(self, index):
        self.read.append(int(index))
        fill = np.full(4, 1000 * self.source + index, np.int32)
        return {"tokens": fill, "segment_ids": np.ones(4, np.int32), "positions": np.arange(4)}


def _random_access(n, p, readers):
    rows = [grain.MapDataset.range(10**6).map(r) for r in readers]
    mixture = Mixture(
        [MixtureSource("a", 0.7, rows[0]), MixtureSource("b", 0.3, rows[1])],
        8,
        process_index=p,
        process_count=n,
    )
    return iter(mixture)


def test_random_access_sources_are_read_by_each_process_for_its_rows_only():
    alone = [_Reads(0), _Reads(1)]
    want = _take(_random_access(1, 0, alone), 6)
    # Each source's rows in order, its row index going on across batches.
    for source in (0, 1):
        assert sorted(alone[source].read) == list(range(len(alone[source].read)))
    readers = {p: [_Reads(0), _Reads(1)] for p in range(2)}
    two = [_random_access(2, p, readers[p]) for p in range(2)]
    for w in want:
        halves = [next(it) for it in two]
        for key in w:
            np.testing.assert_array_equal(np.concatenate([h[key] for h in halves]), w[key])
    for source in (0, 1):  # disjoint reads, together the one-process run's
        read = [set(readers[p][source].read) for p in range(2)]
        assert not read[0] & read[1]
        assert read[0] | read[1] == set(alone[source].read)
    # The position is the same global fact; it resumes on another process count.
    state = _json(two[0].get_state())
    assert state == _json(two[1].get_state())
    more = _take(_random_access(1, 0, [_Reads(0), _Reads(1)]), 9)[6:]
    resumed = _random_access(1, 0, [_Reads(0), _Reads(1)])
    resumed.set_state(state)
    _same(_take(resumed, 3), more)


# ----------------------------------------------------------------------------- token stores


@pytest.fixture
def store_reads(monkeypatch):
    """{(process, store path): [row numbers read]}, for the process named by `reader[0]`."""
    read, reader = {}, [0]
    original = store_rows_module._ReadRow.__call__

    def counting(self, row):
        key = (reader[0], self.layout.store.path)
        read.setdefault(key, []).append(int(row))
        return original(self, row)

    monkeypatch.setattr(store_rows_module._ReadRow, "__call__", counting)
    return read, reader


@pytest.mark.parametrize("kind", ["store_and_text", "two_stores"])
def test_store_sources_are_read_by_each_process_for_its_rows_only(
    sources, stores, store_reads, kind
):
    """1, 2 and 4 processes: the batches of 2 and 4 concatenate to one process's, each
    process reads from a store only the rows of its share (disjoint, together one process's
    reads, as many as its rows of that store), the position is one fact that resumes from 4
    processes onto 2, and the stores are never read as a stream."""
    read, reader = store_reads
    paths = _kinds(sources, stores, kind)
    steps = 12  # 67 rows of store a, within its first epoch (about 113 rows of 16)
    reference, reference_reads, states = None, None, {}
    for n in (1, 2, 4):
        read.clear()
        iterators = []
        for p in range(n):
            reader[0] = p  # the process whose iterator reads from here on
            iterators.append(_iterator(paths, p=p, n=n))
        batches, own = [], np.zeros((n, 2), int)  # each process's rows of each source
        for _ in range(steps):
            local = []
            for p, it in enumerate(iterators):
                reader[0] = p
                local.append(next(it))
                own[p] += np.bincount(local[-1][SOURCE_IDS], minlength=2)
                for source, name in enumerate("ab"):  # its store reads: its rows, no more
                    if paths[name] == stores[name]:
                        assert len(read.get((p, paths[name]), [])) == own[p, source]
            batches.append({k: np.concatenate([b[k] for b in local]) for k in local[0]})
        if reference is None:
            reference = batches
            reference_reads = {path: rows for (_, path), rows in read.items()}
        _same(batches, reference)
        for path, want in reference_reads.items():
            per_process = [read.get((p, path), []) for p in range(n)]
            everything = [r for rows in per_process for r in rows]
            assert len(set(everything)) == len(everything) == len(want)  # disjoint
            assert sorted(everything) == sorted(want)  # together one process's
        states[n] = [_json(it.get_state()) for it in iterators]
    # One fact, the same on every process of every count.
    state = states[1][0]
    assert all(s == state for n in (1, 2, 4) for s in states[n])
    assert sorted(state["streams"]) == (["b"] if kind == "store_and_text" else [])
    # Resume: 4 processes' position onto 2 gives the uninterrupted run's next batches.
    more = _take(_iterator(paths), steps + 3)[steps:]
    two = [_iterator(paths, p=p, n=2) for p in range(2)]
    for it in two:
        it.set_state(state)
    for want in more:
        halves = [next(it) for it in two]
        for key in want:
            np.testing.assert_array_equal(np.concatenate([h[key] for h in halves]), want[key])


def test_a_store_validation_split_is_read_whole_in_order(sources, stores):
    """Unshuffled (validation), a store gives its split's rows in order, the last padded,
    then again from the first: every token of the split, as a single store evaluates."""
    mixed = make_mixture(
        _components(stores),
        "validation",
        BYTE,
        16,
        8,
        seed=3,
        validation_fraction=0.2,
        num_batches=12,
        process_index=0,
        process_count=1,
    )
    batches = list(mixed)
    assert len(batches) == 12
    for source, name in enumerate("ab"):
        one_pass = store_rows_module.store_rows(
            stores[name], "validation", 16, shuffle=False, repeat=False, validation_fraction=0.2
        )
        want = [one_pass[i]["tokens"] for i in range(len(one_pass))]
        assert (want[-1] == 0).any() and len(want) > 3  # a padded last row, then around
        got = _rows_of(batches, source)
        assert len(got) > len(want)
        np.testing.assert_array_equal(got, [want[i % len(want)] for i in range(len(got))])


def test_a_store_of_another_tokenizer_or_position_is_refused(sources, stores):
    other = types.SimpleNamespace(vocab_size=300, eos_id=256, path=None)
    with pytest.raises(ValueError) as e:
        make_mixture(_components(stores), "train", other, 16, 8, process_index=0, process_count=1)
    message = str(e.value)
    assert message.startswith("data.mixture source 'a': ") and "\n" not in message
    assert "was tokenized with 'byte' (vocab 257" in message and "(vocab 300" in message
    # A position that read a source as a stream does not resume it row by row.
    state = _json(_iterator(sources).get_state())
    rows = _iterator({"a": stores["a"], "b": sources["b"]})
    with pytest.raises(ValueError, match=r"reads the sources \['a', 'b'\] as streams, this"):
        rows.set_state(state)


def test_with_a_validation_source_the_mixture_trains_on_all_of_each_shuffled(sources, stores):
    """data.validation_source: each source's split 'all' trains, shuffled as 'train' is."""
    from _train_helpers import run_config

    from nnx_zoo.launch.data import build_data

    paths = {"a": stores["a"], "b": sources["b"]}
    run = run_config(
        {
            "data.mixture": f"a:{paths['a']}:0.7,b:{paths['b']}:0.3",
            "data.validation_source": sources["a"],
            "data.seq_len": 16,
            "data.global_batch_size": 8,
            "data.shuffle_seed": 3,
        }
    )
    built = build_data(run, None, None)
    got = _take(built.train_iter, 4)
    built.close()
    _same(got, _take(_iterator(paths, split="all", shuffle=True), 4))
    in_order = _take(_iterator(paths, split="all", shuffle=False), 4)
    assert not np.array_equal(got[0]["tokens"], in_order[0]["tokens"])


# ----------------------------------------------------------------------------- workers


_WORKERS_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from nnx_zoo.data.mixture import make_mixture
    from nnx_zoo.data.tokenizers import ByteTokenizer
    from nnx_zoo.training.mixture_spec import parse_mixture

    def make(workers, state=None):
        it = make_mixture(parse_mixture(sys.argv[1]), "train", ByteTokenizer(), 16, 8, seed=3,
                          process_index=0, process_count=1, num_workers=workers)
        if state is not None:
            it.set_state(state)
        return it

    def take(it, n):
        return np.stack([next(it)["tokens"] for _ in range(n)])

    if __name__ == "__main__":
        alone, two = make(0), make(1)
        np.testing.assert_array_equal(take(two, 5), take(alone, 5))
        state = json.loads(json.dumps(two.get_state()))
        assert state == alone.get_state()
        want = take(alone, 4)
        resumed = make(1, state)
        np.testing.assert_array_equal(take(resumed, 4), want)
        for it in (two, resumed):
            it.close()
        print("WORKERS_OK")
    """
)


@pytest.mark.parametrize("kind", ["text", "store_and_text"])
def test_worker_processes_change_neither_the_batches_nor_the_position(
    sources, stores, tmp_path, kind
):
    from test_data import _run_script

    paths = _kinds(sources, stores, kind)
    script = tmp_path / "workers.py"
    script.write_text(_WORKERS_SCRIPT)
    proc = _run_script(script, f"a:{paths['a']}:0.7,b:{paths['b']}:0.3")
    assert proc.returncode == 0 and "WORKERS_OK" in proc.stdout, proc.stderr[-3000:]


# ----------------------------------------------------------------------------- train_main


def test_the_loop_strips_the_source_ids_and_they_name_the_same_key():
    assert loop.SOURCE_IDS == SOURCE_IDS
    batch = {"tokens": 1, SOURCE_IDS: 2}
    assert loop.model_batch(batch) == {"tokens": 1}


def _run(workdir, mixture, steps):
    flags = {
        **SMALL_SHAPES,
        "data.mixture": mixture,
        "training.steps": steps,
        "training.eval_every": 0,
        "training.eval_batches": 1,
        **QUIET_LOGS,
        "checkpoint.every": 3,
        # One schedule for both legs of the resumed run.
        "optimizer.warmup_steps": 1,
        "optimizer.decay_steps": 6,
    }
    return run_train_main([f"--workdir={workdir}", *cli_flags(flags)])


def _source_tokens(batches):
    """[steps, 2]: each step's non-padding tokens per source, counted from the batches."""
    return np.array(
        [[np.sum(b["segment_ids"][b[SOURCE_IDS] == s] != 0) for s in (0, 1)] for b in batches]
    )


def test_train_main_logs_tokens_per_source_and_resumes_by_its_rules(sources, tmp_path):
    from _train_helpers import assert_evaluates_under_dp

    workdir = str(tmp_path / "run")
    seq_len, batch = SMALL_SHAPES["data.seq_len"], SMALL_SHAPES["data.global_batch_size"]
    mixture = f"a:{sources['a']}:0.7,b:{sources['b']}:0.3"
    result = _run(workdir, mixture, 3)
    assert result.returncode == 0, result.stderr[-3000:]

    # The stream the run read, rebuilt: 3 steps at 0.7 / 0.3, then 2 at 0.5 / 0.5.
    def stream(wa, wb):
        return make_mixture(
            _components(sources, wa, wb),
            "train",
            BYTE,
            seq_len,
            batch,
            seed=0,
            process_index=0,
            process_count=1,
        )

    first = stream(0.7, 0.3)
    want = _source_tokens(_take(first, 3))
    second = stream(0.5, 0.5)
    second.set_state(_json(first.get_state()))
    want = np.concatenate([want, _source_tokens(_take(second, 2))])

    resumed = _run(workdir, f"a:{sources['a']}:0.5,b:{sources['b']}:0.5", 5)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (
        "data.mixture weights differ from checkpoint step 3's (a 0.7 -> 0.5, b 0.3 -> 0.5): "
        "each source continues where it was, the new weights apply from step 3 on"
    ) in resumed.stdout + resumed.stderr
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5]
    got = np.array([[r["tokens/a"], r["tokens/b"]] for r in train])
    np.testing.assert_array_equal(got, want)
    assert (got.sum(axis=1) <= seq_len * batch).all() and got.min() > 0
    assert any("val_loss" in r for r in records)
    # eval_main evaluates the run's own validation mixture: the val_loss it logged.
    assert_evaluates_under_dp(workdir, 5)

    # Other sources: refused in one line naming the difference, nothing written.
    changed = _run(workdir, f"a:{sources['a']}:0.5,c:{sources['b']}:0.5", 6)
    assert changed.returncode == 2
    line = changed.stderr.strip().splitlines()[-1]
    assert "data.mixture differs from checkpoint step 5's in its sources" in line
    assert f"added c:{sources['b']}; removed b:{sources['b']}" in line
    bad = _run(str(tmp_path / "other"), "a:/x", 1)
    assert bad.returncode == 2 and "config data.mixture: 'a:/x' is not" in bad.stderr
