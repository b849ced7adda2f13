"""A request's text as the serving engine streams it (nnx_zoo/serving/text.py): decoded
incrementally, the deltas add up to the tokenizer's decode of the whole sequence (byte-level
BPE, SentencePiece-style byte fallback with its leading space, the byte tokenizer, characters
of several tokens), cut at the first stop string exactly where decoding the whole text and
searching it would cut; and the work per token stays bounded however long the text grows."""

from __future__ import annotations

import json
import random
import threading
import time

import pytest
from chat_fixtures import CORPUS, write_tokenizer_dir

from nnx_zoo.data.tokenizers import ByteTokenizer, HfTokenizer
from nnx_zoo.serving.text import MAX_STOP_CHARS, MAX_STOP_STRINGS, TextStream, _stop_prefix_len

TEXT = (
    "Hello there! é, 日本語 and 🙂 in one line.\n\ndef add(a, b):\n    return a + b\n"
    "The sea is wide and deep and blue.  Ünïcödé  \t end"
)


def _byte_fallback_tokenizer(directory) -> HfTokenizer:
    """A SentencePiece-style BPE as Llama 2 ships it: '▁' for spaces, the first one stripped
    on decode, and characters outside the vocabulary as <0xAB> byte tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"])
    tok.train_from_iterator(CORPUS * 4, trainer)
    spec = json.loads(tok.to_str())
    for byte in range(256):
        spec["model"]["vocab"].setdefault(f"<0x{byte:02X}>", len(spec["model"]["vocab"]))
    spec["model"]["byte_fallback"] = True
    spec["decoder"] = {
        "type": "Sequence",
        "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0},
        ],
    }
    path = directory / "tokenizer.json"
    path.write_text(json.dumps(spec), encoding="utf-8")
    return HfTokenizer(str(path))


@pytest.fixture(scope="module", params=["byte", "byte_level_bpe", "byte_fallback"])
def tokenizer(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    if request.param == "byte":
        return ByteTokenizer()
    if request.param == "byte_level_bpe":
        return HfTokenizer(f"{write_tokenizer_dir(str(directory), 'qwen3')}/tokenizer.json")
    return _byte_fallback_tokenizer(directory)


def _stream(tokenizer, ids, **kwargs):
    stream = TextStream(tokenizer, max_tokens=kwargs.pop("max_tokens", len(ids)), **kwargs)
    deltas = []
    for token in ids:
        delta = stream.add(token)
        deltas.append(delta.text)
        if delta.finish_reason:
            break
    return stream, deltas


def _reference(tokenizer, ids, stops):
    """What decoding the whole sequence after every token and searching it gives: the text
    up to the first stop string in the first prefix that holds one, else the whole text."""
    for n in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:n])
        found = [at for at in (text.find(s) for s in stops) if at >= 0]
        if found:
            return text[: min(found)], "stop"
    return tokenizer.decode(ids), "length"


def test_the_deltas_add_up_to_the_whole_decode(tokenizer):
    ids = tokenizer.encode(TEXT)
    assert tokenizer.decode(ids) == TEXT
    stream, deltas = _stream(tokenizer, ids)
    assert "".join(deltas) == stream.text == TEXT and stream.finish_reason == "length"
    # No delta is a half character (U+FFFD while the rest of its bytes are on their way).
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("stop", ["deep", "\n\n", "日本", "🙂 in", " b\n", "never there"])
def test_cut_at_the_first_stop_string_as_the_whole_decode_would(tokenizer, stop):
    ids = tokenizer.encode(TEXT)
    stops = [stop, "sea is wide"]
    stream, deltas = _stream(tokenizer, ids, stop=stops)
    want, reason = _reference(tokenizer, ids, stops)
    assert ("".join(deltas), stream.finish_reason) == (want, reason)
    assert stream.text == want


def test_random_bytes_stream_as_they_decode():
    """A random model's bytes are mostly not UTF-8: the replacement characters of the whole
    decode, split wherever the tokens end."""
    rng = random.Random(0)
    tokenizer = ByteTokenizer()
    for _ in range(20):
        ids = [rng.choice([rng.randrange(256), rng.randrange(32, 127)]) for _ in range(200)]
        stream, deltas = _stream(tokenizer, ids, stop=["ab", "\x00\x01"])
        assert "".join(deltas) == _reference(tokenizer, ids, ["ab", "\x00\x01"])[0]


class _Counting(ByteTokenizer):
    """Counts the token ids it is asked to decode."""

    decoded = 0

    def decode(self, ids):
        self.decoded += len(ids)
        return super().decode(ids)


def test_the_work_per_token_does_not_grow_with_the_text():
    """4,000 tokens with the most stop strings a request may ask for, none of them in the
    text (so every token is searched): each token's decode sees a window of a few tokens,
    not the whole text, and what is held back never passes the longest stop string."""
    tokenizer = _Counting()
    rng = random.Random(1)
    stops = ["".join(rng.choice("xyz") for _ in range(MAX_STOP_CHARS))] * MAX_STOP_STRINGS
    stops[0] = "q" + stops[0][1:]  # one stop whose start the text holds (q) all the time
    ids = [rng.choice(b"abcdq ") for _ in range(4000)]
    stream = TextStream(tokenizer, max_tokens=len(ids) + 1, stop=stops)
    sent = held = 0
    for n, token in enumerate(ids, 1):
        sent += len(stream.add(token).text)
        held = max(held, n - sent)  # (ASCII: n tokens are n characters)
    assert tokenizer.decoded <= 4 * len(ids)  # (decoding the whole text each time: 8 million)
    assert 0 < held < MAX_STOP_CHARS
    assert stream.text == bytes(ids).decode()[:sent]


def test_held_back_length_is_the_longest_stop_prefix():
    rng = random.Random(2)
    for _ in range(500):
        text = "".join(rng.choice("ab\n") for _ in range(rng.randrange(0, 12)))
        stops = ["".join(rng.choice("ab\n") for _ in range(rng.randrange(1, 6))) for _ in "xyz"]
        # The definition, checked the slow way: every end of the text against every stop.
        want = max(
            (
                n
                for s in stops
                for n in range(1, min(len(s) - 1, len(text)) + 1)
                if text.endswith(s[:n])
            ),
            default=0,
        )
        assert _stop_prefix_len(text, stops) == want, (text, stops)


def test_an_hf_tokenizer_encodes_a_long_prompt_while_other_threads_run(tmp_path):
    """The server tokenizes prompts on a worker thread; with an HF tokenizer that is only
    worth it if the engine thread and the event loop run meanwhile."""
    tokenizer = HfTokenizer(f"{write_tokenizer_dir(str(tmp_path), 'qwen3')}/tokenizer.json")
    text = TEXT * 3000  # ~0.5 MB
    ticks, done = [], threading.Event()

    def tick():
        while not done.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    thread = threading.Thread(target=tick)
    thread.start()
    time.sleep(0.05)
    start = time.perf_counter()
    ids = tokenizer.encode_concurrently(text)
    took = time.perf_counter() - start
    done.set()
    thread.join()
    assert ids == tokenizer.encode(text)
    during = [t for t in ticks if start <= t <= start + took]
    gaps = [b - a for a, b in zip([start, *during], [*during, start + took], strict=True)]
    assert took > 0.1 and max(gaps) < took / 2, (took, max(gaps))
