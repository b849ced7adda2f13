"""The serving engine in-process (nnx_zoo/serving/): continuous batching equals zoo.generate
token for token, alone and batched with requests of other lengths, one device and a
(data 2, model 2) mesh; seeded sampling is the same alone and batched; decode is traced once
and prefill once per length bucket; slots are reused as requests finish; the scheduler's
queue bound and cancellation; the text stream's stop strings and held-back text."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from _serving_helpers import perturbed_model
from flax import nnx

from nnx_zoo.data.tokenizers import ByteTokenizer
from nnx_zoo.serving.engine import Engine
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
