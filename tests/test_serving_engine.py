"""The serving engine in-process (nnx_zoo/serving/): continuous batching equals zoo.generate
token for token, alone and batched with requests of other lengths, one device and a
(data 2, model 2) mesh; seeded sampling is the same alone and batched; decode is traced once
and prefill once per length bucket; slots are reused as requests finish; the scheduler's
queue bound and cancellation; the text stream's stop strings and held-back text."""

from __future__ import annotations

import functools
import queue
import threading
import time

import jax
import numpy as np
import pytest
from _serving_helpers import FailOnce, dying_engine, perturbed_model
from flax import nnx

from nnx_zoo.data.tokenizers import ByteTokenizer
from nnx_zoo.serving.engine import Engine, EngineStoppedError
from nnx_zoo.serving.scheduler import Job, QueueFullError, Sampling, Scheduler
from nnx_zoo.serving.slots import Slots, buckets
from nnx_zoo.serving.text import TextStream
from shardings import get_strategy
from zoo import get_config
from zoo.generate import generate, layer_list
from zoo.layers.lora import LoraConfig, LoraParam, add_lora

CFG = get_config("tiny").replace(hidden_dim=64, num_layers=2, ffn_dim=128)
MAX_SEQ_LEN = 32  # buckets 16, 32
TOKENIZER = ByteTokenizer()
# Lengths in both buckets (9, 5 -> 16; 18, 20 -> 32), with room for NEW tokens.
PROMPTS = [
    list(b"def f(x):"),
    list(b"hello"),
    list(b"import numpy as np"),
    list(b"The quick brown fox "),
]
NEW = 12
SHORT = [PROMPTS[0], PROMPTS[1], list(b"x = 1")]  # one bucket (16)


def _model(strategy_name: str, shape: tuple[int, ...]):
    strategy = get_strategy(strategy_name)
    mesh = strategy.make_mesh(shape=shape, devices=jax.devices()[: int(np.prod(shape))])
    model = perturbed_model(CFG, strategy, mesh, scale=0.05)
    return model, mesh


def _reference(model, mesh, prompts, n=NEW):
    """zoo.generate on the prompts as one left-padded batch (one compile), EOS not stopping.
    (tests/test_serving_api.py checks eval_main --prompt itself, one prompt at a time.)"""
    with jax.set_mesh(mesh):
        return generate(model, prompts, max_new_tokens=n)


@pytest.fixture(scope="module")
def one_device():
    model, mesh = _model("fsdp_tp", (1, 1))
    engine = Engine(Slots(model, max_batch=4, max_seq_len=MAX_SEQ_LEN), TOKENIZER, max_queue=16)
    engine.start()
    yield model, mesh, engine
    engine.stop()


def _ids(streams):
    return [s.ids for s in streams]


def test_greedy_equals_generate_alone_and_batched(one_device):
    model, mesh, engine = one_device
    want = _reference(model, mesh, PROMPTS)
    alone = [_ids(engine.generate([p], max_tokens=NEW, ignore_eos=True))[0] for p in PROMPTS]
    assert alone == want
    # All at once: 4 slots, prompts of three buckets joining one batch.
    assert _ids(engine.generate(PROMPTS, max_tokens=NEW, ignore_eos=True)) == want
    # More requests than slots: queued, admitted as slots free up, same tokens.
    mixed = PROMPTS * 2
    assert _ids(engine.generate(mixed, max_tokens=NEW, ignore_eos=True)) == want * 2


def test_seeded_sampling_same_alone_and_batched(one_device):
    _, _, engine = one_device
    settings = Sampling(temperature=0.9, top_k=50, top_p=0.95, seed=1234)
    alone = engine.generate([PROMPTS[0]], max_tokens=NEW, sampling=settings, ignore_eos=True)
    others = [Sampling(temperature=1.3, seed=7), Sampling(), Sampling(temperature=0.5, seed=9)]
    # Batched after other requests, so it lands in another slot.
    batched = engine.generate(
        [PROMPTS[2], PROMPTS[1], PROMPTS[3], PROMPTS[0]],
        max_tokens=NEW,
        sampling=[*others, settings],
        ignore_eos=True,
    )
    assert batched[3].ids == alone[0].ids
    assert batched[3].text == alone[0].text
    # Another seed draws differently (the seed is used at all).
    other = engine.generate(
        [PROMPTS[0]], max_tokens=NEW, sampling=Sampling(0.9, 50, 0.95, 99), ignore_eos=True
    )
    assert other[0].ids != alone[0].ids


def test_compiled_once_per_bucket_and_slots_reused(one_device):
    _, _, engine = one_device
    # What --warmup does: the other tests of the module may have run before this one, or not.
    engine.slots.compile_decode()
    for bucket in engine.slots.buckets:
        engine.slots.compile_prefill(bucket)
    before = dict(engine.slots.traces)
    lengths = [1, 3, 7, 15, 16, 17, 25, 29]  # buckets 16 and 32 again
    prompts = [list(range(65, 65 + n)) for n in lengths]
    streams = engine.generate(prompts, max_tokens=3, ignore_eos=True)
    assert all(len(s.ids) == 3 and s.finish_reason == "length" for s in streams)
    traces = dict(engine.slots.traces)
    assert traces == before, "a request traced a program again"
    assert traces["decode"] == 1
    assert {k for k in traces if k != "decode"} == {("prefill", b) for b in buckets(MAX_SEQ_LEN)}
    assert all(v == 1 for v in traces.values())
    status = engine.status()
    assert status["running"] == status["waiting"] == 0
    assert status["peak_running"] == 4  # never more than the slots


def test_engine_refuses_what_does_not_fit(one_device):
    _, _, engine = one_device
    make = lambda prompt, n: engine.job(  # noqa: E731
        prompt, max_tokens=n, sampling=Sampling(), on_event=print
    )
    with pytest.raises(ValueError, match="maximum context length is 32"):
        make([1] * 30, 5)
    with pytest.raises(ValueError, match="max_tokens=0"):
        make([1], 0)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        make([1, 9999], 1)
    with pytest.raises(ValueError, match="empty"):
        make([], 1)


def test_sharded_mesh_equals_one_device(one_device):
    """fsdp_tp on (data 2, model 2): prefill runs 2 rows (the batch divides over data), the
    cache is split over data and kv heads; the same weights (seeded, laid out differently)
    give the one-device engine's tokens. (Float32 throughout; the o / down projections'
    contractions over the model axis change only the summation order, ~1e-7 relative, far
    below the margins between a perturbed model's top logits.)"""
    _, _, alone = one_device
    want = _ids(alone.generate(SHORT, max_tokens=6, ignore_eos=True))
    model, _ = _model("fsdp_tp", (2, 2))
    slots = Slots(model, max_batch=4, max_seq_len=16)
    assert slots.rows == 2
    assert jax.typeof(slots.cache.k).sharding.spec[1:4] == ("data", None, "model")
    engine = Engine(slots, TOKENIZER, max_queue=8).start()
    try:
        # Three prompts of one bucket: two prefills of 2 rows, the second with a spare row.
        assert _ids(engine.generate(SHORT, max_tokens=6, ignore_eos=True)) == want
        # The empty cache put in place after a failed call has the old one's layouts: the
        # compiled programs take it as they are (no new trace), with the same tokens.
        layouts = [jax.typeof(leaf).sharding for leaf in jax.tree.leaves(slots.cache)]
        traces = dict(slots.traces)
        slots.reset()
        assert [jax.typeof(leaf).sharding for leaf in jax.tree.leaves(slots.cache)] == layouts
        assert _ids(engine.generate(SHORT, max_tokens=6, ignore_eos=True)) == want
        assert dict(slots.traces) == traces
    finally:
        engine.stop()


def test_lora_adapters_survive_the_per_layer_split(one_device):
    """serve_main --lora=apply keeps a LoRA run's adapters beside the weights: the decode's
    per-layer weights (`layer_list`, whose twin is built from the config and would drop
    adapters added after construction) keep every adapter; such a model decodes through the
    layer scan, with the adapters."""
    base, mesh, _ = one_device
    with jax.set_mesh(mesh):
        model = nnx.clone(base)  # the fixture's model stays as it is
        add_lora(model, LoraConfig(rank=4, alpha=8.0, targets=("q_proj", "down")), nnx.Rngs(1))
    graphdef, state = layer_list(model)
    kept = jax.tree.leaves(nnx.state(nnx.merge(graphdef, state), LoraParam))
    assert len(kept) == len(jax.tree.leaves(nnx.state(model, LoraParam))) == 4  # A, B x 2


# -- failures ---------------------------------------------------------------------------------


def _submit(engine, prompts, max_tokens=NEW, **kwargs):
    """Submit one job per prompt; returns (jobs, finals): finals[i].get(timeout) is job i's
    last event."""
    finals = [queue.SimpleQueue() for _ in prompts]
    jobs = []
    for prompt, final in zip(prompts, finals, strict=True):
        job = engine.job(
            prompt, max_tokens=max_tokens, sampling=Sampling(), ignore_eos=True, on_event=None
        )
        job.on_event = functools.partial(_put_last, final)
        jobs.append(job)
    engine.submit(jobs)
    return jobs, finals


def _put_last(final: queue.SimpleQueue, event) -> None:
    if event.finish_reason is not None:
        final.put(event)


def test_a_failed_decode_fails_the_requests_in_the_cache_and_serves_the_next(
    one_device, monkeypatch
):
    """Both programs donate the KV cache: a decode that fails takes it along. The four
    requests in it fail (naming the cause), the two that waited for a slot are served on a
    fresh cache, token for token as alone, and so is the next request."""
    _, _, engine = one_device
    prompts = [*PROMPTS, *SHORT[:2]]
    alone = [_ids(engine.generate([p], max_tokens=NEW, ignore_eos=True))[0] for p in prompts]
    decode = engine.slots.compile_decode()
    fail = FailOnce(at=3)  # mid-generation
    monkeypatch.setattr(engine.slots, "compile_decode", lambda: fail.wrap(decode))
    before = engine.status()
    jobs, finals = _submit(engine, prompts)
    events = [final.get(timeout=120) for final in finals]
    assert fail.failed
    for event in events[:4]:
        assert event.finish_reason == "error"
        assert "injected: the device call failed" in event.error
    assert [e.finish_reason for e in events[4:]] == ["length", "length"]
    assert [job.stream.ids for job in jobs[4:]] == alone[4:]
    assert _ids(engine.generate(PROMPTS[:1], max_tokens=NEW, ignore_eos=True)) == alone[:1]
    status = engine.status()
    assert status["cache_resets"] == before["cache_resets"] + 1
    assert status["failed"] == before["failed"] + 4 and status["stopped"] is None


def test_a_failed_prefill_fails_the_requests_in_the_cache_not_those_still_to_prefill(
    one_device, monkeypatch
):
    """Three requests admitted in one turn, prefilled one by one: the second prefill fails.
    The first (in the lost cache) and the second fail; the third, not yet prefilled, is
    served on the fresh cache with its own tokens."""
    _, _, engine = one_device
    alone = [_ids(engine.generate([p], max_tokens=NEW, ignore_eos=True))[0] for p in SHORT]
    compile_prefill = engine.slots.compile_prefill
    fail = FailOnce(at=2)
    monkeypatch.setattr(
        engine.slots, "compile_prefill", lambda b, score=False: fail.wrap(compile_prefill(b, score))
    )
    jobs, finals = _submit(engine, SHORT)
    events = [final.get(timeout=120) for final in finals]
    assert [e.finish_reason for e in events] == ["error", "error", "length"]
    assert all("injected" in e.error for e in events[:2])
    assert jobs[2].stream.ids == alone[2]


class _RaisingTokenizer(ByteTokenizer):
    """Decodes until its `after`-th call, then raises (a tokenizer bug on some output)."""

    def __init__(self, after: int):
        super().__init__()
        self.calls, self.after = 0, after

    def decode(self, ids):
        self.calls += 1
        if self.calls > self.after:
            raise UnicodeError("injected: this request's text cannot be decoded")
        return super().decode(ids)


def test_a_decode_error_fails_that_request_alone(one_device):
    """Turning one request's tokens into text raises (outside the device calls): that
    request fails with the cause; the others finish with their own tokens and the engine
    goes on."""
    _, _, engine = one_device
    alone = [_ids(engine.generate([p], max_tokens=NEW, ignore_eos=True))[0] for p in SHORT]
    jobs, finals = _submit(engine, SHORT)
    jobs[1].stream.tokenizer = _RaisingTokenizer(after=5)
    events = [final.get(timeout=120) for final in finals]
    assert [e.finish_reason for e in events] == ["length", "error", "length"]
    assert "injected: this request's text" in events[1].error
    assert [jobs[0].stream.ids, jobs[2].stream.ids] == [alone[0], alone[2]]
    assert engine.stopped() is None


def test_an_engine_thread_that_dies_fails_every_request_and_refuses_new_ones(one_device):
    """Anything that escapes the engine's loop (here the scheduler) ends its thread: the
    request waiting gets an error at once, not never; a new one is refused; `stopped` says
    why. (A second engine over the same slots; it dies before any device call.)"""
    _, _, live = one_device
    with dying_engine(live.slots, TOKENIZER, max_queue=4) as (engine, reached, go):
        _, finals = _submit(engine, SHORT[:1])
        assert reached.wait(30)  # the request is in, the engine thread about to fail
        go.set()
        event = finals[0].get(timeout=1.0)
        assert event.finish_reason == "error" and "injected: a scheduler bug" in event.error
        assert "injected: a scheduler bug" in engine.stopped()
        assert engine.status()["stopped"] == engine.stopped()
        with pytest.raises(EngineStoppedError, match="a scheduler bug"):
            _submit(engine, SHORT[:1])


def test_the_counters_are_written_under_the_lock(one_device, monkeypatch):
    """`status` reads the counters under the engine's lock; the engine thread writes them
    under it too: while another thread holds the lock, a finished decode step does not count
    itself until it is let go."""
    _, _, engine = one_device
    decode = engine.slots.compile_decode()
    in_call, go = threading.Event(), threading.Event()

    def held(*args):
        out = decode(*args)
        in_call.set()
        go.wait(30)
        return out

    monkeypatch.setattr(engine.slots, "compile_decode", lambda: held)
    _, finals = _submit(engine, SHORT[:1], max_tokens=2)
    assert in_call.wait(60)
    with engine._cond:  # what status() takes
        steps = engine.steps
        go.set()
        time.sleep(0.3)  # the engine thread returns from the call and counts the step...
        assert engine.steps == steps  # ...only once it holds the lock
    assert finals[0].get(timeout=60).finish_reason == "length"
    assert engine.status()["decode_steps"] == steps + 1


# -- host-side pieces -------------------------------------------------------------------------


def _job(name=""):
    stream = TextStream(TOKENIZER, max_tokens=4)
    return Job(list(name.encode() or b"x"), Sampling(), stream, on_event=None)


def test_scheduler_queue_bound_admission_and_cancel():
    sched = Scheduler(max_batch=2, max_queue=1)
    a, b, c, d, e = (_job(x) for x in "abcde")
    sched.submit([a, b, c])  # two for the free slots, one waiting
    with pytest.raises(QueueFullError, match="--max_queue=1"):
        sched.submit([d])
    assert sched.admit() == [a, b] and (a.slot, b.slot) == (0, 1)
    with pytest.raises(QueueFullError):
        sched.submit([d])  # c waits; the queue holds one
    assert sched.admit() == []  # no free slot
    b.cancelled = True
    assert sched.drop_cancelled() == [b]  # b's slot is free at once
    sched.submit([d])  # one free slot + one queue place: c and d
    c.cancelled = True
    assert sched.admit() == [d] and d.slot == 1  # c dropped while waiting
    sched.release(a)
    assert sched.running() == [d] and not sched.waiting and sched.has_work()
    sched = Scheduler(max_batch=1, max_queue=1)
    with pytest.raises(QueueFullError):
        sched.submit([e, _job(), _job()])  # all or nothing
    assert not sched.waiting


def test_a_full_queue_counts_what_it_holds():
    """The 503's message counts the sequences running and waiting and the requests they
    came in, not the slots."""
    sched = Scheduler(max_batch=4, max_queue=2)
    sched.submit([_job("a")])
    sched.admit()  # one running, three slots free
    sched.submit([_job("b"), _job("c")])  # one request of two, for the free slots
    with pytest.raises(QueueFullError) as refused:
        sched.submit([_job() for _ in range(4)])  # 3 free + 2 queue places - 2 waiting < 4
    assert str(refused.value) == (
        "the server is at capacity: 1 of 4 slots busy and 2 sequences waiting (--max_queue=2), "
        "from 2 requests; this request needs room for 4 sequences (prompts x n); retry later"
    )
    assert sched.capacity == 6


def _feed(stream, text: str):
    out = []
    for byte in text.encode():
        delta = stream.add(byte)
        out.append(delta.text)
        if delta.finish_reason:
            break
    return out, stream


def test_text_stream_stop_strings_and_held_back_text():
    out, s = _feed(TextStream(TOKENIZER, max_tokens=100, stop=["\n\nUser:", "END"]), "ab\n\nUs!x")
    # "\n\nUs" is held back while it could start a stop string, then let go at "!".
    assert out == ["a", "b", "", "", "", "", "\n\nUs!", "x"]
    out, s = _feed(TextStream(TOKENIZER, max_tokens=100, stop=["\n\nUser:"]), "hi\n\nUser: x")
    assert "".join(out) == s.text == "hi" and s.finish_reason == "stop"
    assert s.num_tokens == len(b"hi\n\nUser:")
    # A character of several bytes is sent whole, never as U+FFFD.
    out, s = _feed(TextStream(TOKENIZER, max_tokens=100), "é!")
    assert out == ["", "é", "!"]
    # The budget, and EOS (counted, not shown).
    out, s = _feed(TextStream(TOKENIZER, max_tokens=3), "abcdef")
    assert (s.text, s.finish_reason, s.num_tokens) == ("abc", "length", 3)
    s = TextStream(TOKENIZER, max_tokens=9, eos_id=TOKENIZER.eos_id)
    s.add(ord("a"))
    assert s.add(TOKENIZER.eos_id) == ("", "stop") and (s.text, s.num_tokens) == ("a", 2)
