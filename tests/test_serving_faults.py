"""The HTTP server under failures and abuse (issue 48 item 5), in-process: the app over an
engine on a tiny model, served by uvicorn on a thread, driven over real sockets. A device
call that fails is a 500 naming the cause and the next request is served; an engine thread
that dies turns /health to 503 and every waiting or new request to a 500 within a second; a
request of more prompts x n than the server can ever hold is a 400; stop strings past the
bound are a 400; a body past the limit is a 413 before it is read (declared or streamed);
tokenizing a prompt does not hold up the event loop."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import jax
import pytest
from _serving_helpers import FailOnce, dying_engine, http_server, perturbed_model, post_json

from nnx_zoo.data.tokenizers import ByteTokenizer
from nnx_zoo.serving.api import DEFAULT_MAX_REQUEST_BYTES, create_app
from nnx_zoo.serving.engine import Engine
from nnx_zoo.serving.slots import Slots
from nnx_zoo.serving.text import MAX_STOP_CHARS, MAX_STOP_STRINGS
from shardings import get_strategy
from zoo import get_config

uvicorn = pytest.importorskip("uvicorn")  # the serve extra

CFG = get_config("tiny").replace(hidden_dim=64, num_layers=2, ffn_dim=128)
NAME = "tiny"
MAX_BATCH, MAX_QUEUE = 4, 4
SLOW = "\x01slow"  # a prompt starting with this takes SLOW_SECONDS to tokenize
SLOW_SECONDS = 1.5


class _Tokenizer(ByteTokenizer):
    """The byte tokenizer; one marked prompt is slow to encode (as a long one would be),
    letting other threads run meanwhile (as a tokenizer that releases the interpreter)."""

    def encode(self, text):
        if text.startswith(SLOW):
            time.sleep(SLOW_SECONDS)
        return super().encode(text)


@pytest.fixture(scope="module")
def slots():
    strategy = get_strategy("fsdp_tp")
    mesh = strategy.make_mesh(shape=(1, 1), devices=jax.devices()[:1])
    model = perturbed_model(CFG, strategy, mesh, scale=0.05)
    return Slots(model, max_batch=MAX_BATCH, max_seq_len=32)


@pytest.fixture(scope="module")
def server(slots):
    engine = Engine(slots, _Tokenizer(), max_queue=MAX_QUEUE).start()
    try:
        with http_server(create_app(engine, served_model=NAME)) as port:
            yield engine, port
    finally:
        engine.stop()


def _get(port, path="/health", timeout=60.0):
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def _ask(prompt="def f(x):", **fields):
    return {"model": NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0, **fields}


def _in_thread(fn, *args, **kwargs):
    """Run fn on a thread; returns a function that waits for its result (or raises)."""
    out = {}

    def run():
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 -- handed to the waiter
            out["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def wait(timeout):
        thread.join(timeout)
        assert not thread.is_alive(), f"no answer within {timeout} s"
        if "error" in out:
            raise out["error"]
        return out["value"]

    return wait


def test_a_failed_device_call_is_a_500_with_its_cause_and_the_next_request_is_served(
    server, slots, monkeypatch
):
    engine, port = server
    status, want = post_json(port, _ask(ignore_eos=True))
    assert status == 200
    decode = slots.compile_decode()
    fail = FailOnce(at=2)
    monkeypatch.setattr(slots, "compile_decode", lambda: fail.wrap(decode))
    status, error = post_json(port, _ask(ignore_eos=True))
    assert status == 500 and fail.failed
    assert error["error"]["type"] == "server_error"
    assert "injected: the device call failed" in error["error"]["message"]
    for _ in range(2):  # the cache rebuilt: served again, the same tokens
        status, again = post_json(port, _ask(ignore_eos=True))
        assert status == 200 and again["choices"] == want["choices"]
    assert _get(port)[0] == 200
    assert engine.status()["cache_resets"] >= 1


def test_an_engine_thread_that_dies_is_a_503_health_and_500s_never_a_hang(server, slots):
    """A second engine over the same slots (it dies before any device call), its own app."""
    _, live_port = server
    with (
        dying_engine(slots, _Tokenizer(), MAX_QUEUE) as (engine, reached, go),
        http_server(create_app(engine, served_model=NAME)) as port,
    ):
        waiting = _in_thread(post_json, port, _ask(), timeout=30)
        assert reached.wait(30)
        go.set()
        start = time.monotonic()
        status, error = waiting(timeout=5)
        assert status == 500 and "injected: a scheduler bug" in error["error"]["message"]
        assert time.monotonic() - start < 1.0
        status, health = _get(port)
        assert status == 503 and health["status"] == "error"
        assert "injected: a scheduler bug" in health["stopped"]
        start = time.monotonic()
        status, error = post_json(port, _ask(), timeout=5)
        assert status == 500 and "the engine stopped" in error["error"]["message"]
        streamed = post_json(port, _ask(stream=True), timeout=5)
        assert streamed[0] == 500
        assert time.monotonic() - start < 1.0
    assert _get(live_port)[0] == 200  # the other engine is untouched


def test_more_prompts_x_n_than_the_server_holds_is_a_400(server):
    _, port = server
    capacity = MAX_BATCH + MAX_QUEUE
    status, error = post_json(port, _ask(prompt=["x = 1"] * 100, n=8))
    assert status == 400, error
    message = error["error"]["message"]
    assert "100 prompts x n=8 = 800 sequences" in message and f"at most {capacity}" in message
    assert error["error"]["param"] == "prompt"
    status, error = post_json(port, _ask(n=capacity + 1))
    assert status == 400 and error["error"]["param"] == "n"
    # Exactly the capacity: admitted (all at once, on an idle server).
    status, body = post_json(port, _ask(prompt=["x = 1", "y = 2"], n=capacity // 2, max_tokens=2))
    assert status == 200 and len(body["choices"]) == capacity


def test_stop_strings_past_the_bound_are_a_400(server):
    _, port = server
    status, error = post_json(port, _ask(stop=["x" * 200] * 5000))
    assert status == 400 and error["error"]["param"] == "stop"
    assert f"at most {MAX_STOP_STRINGS}" in error["error"]["message"]
    status, error = post_json(port, _ask(stop=["y" * (MAX_STOP_CHARS + 1)]))
    assert status == 400 and f"at most {MAX_STOP_CHARS}" in error["error"]["message"]
    # The bound itself is served.
    stops = [chr(0x4E00 + i) * MAX_STOP_CHARS for i in range(MAX_STOP_STRINGS)]
    status, body = post_json(port, _ask(stop=stops, ignore_eos=True))
    assert status == 200 and body["usage"]["completion_tokens"] == 8


def _raw(port, head: bytes, body_parts=(), timeout=10.0):
    """Send `head` (request line and headers) and `body_parts`, then read the answer:
    (status, JSON body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(head)
        for part in body_parts:
            sock.sendall(part)
        response = http.client.HTTPResponse(sock)
        response.begin()
        return response.status, json.loads(response.read())


def test_a_body_past_the_limit_is_a_413_before_it_is_read(server):
    engine, port = server
    # Declared: the answer comes with none of the 200 MB sent.
    head = (
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: 200000000\r\n\r\n"
    )
    status, error = _raw(port, head)
    assert status == 413 and error["error"]["code"] == "request_too_large"
    assert str(DEFAULT_MAX_REQUEST_BYTES) in error["error"]["message"]
    # Streamed without a length (and never finished): counted as it comes, refused as soon
    # as it passes the limit.
    head = (
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"transfer-encoding: chunked\r\n\r\n"
    )
    start = json.dumps(_ask())[:-1].encode() + b', "suffix_pad": "'
    chunk = b"x" * (64 << 10)
    chunks = [start] + [chunk] * (DEFAULT_MAX_REQUEST_BYTES // len(chunk) + 1)
    status, error = _raw(port, head, [b"%x\r\n%s\r\n" % (len(c), c) for c in chunks])
    assert status == 413
    assert post_json(port, _ask())[0] == 200  # and the server goes on


def test_tokenizing_a_prompt_does_not_hold_up_the_event_loop(server):
    """A prompt that takes 1.5 s to tokenize: meanwhile /health answers at once and another
    request is served."""
    _, port = server
    slow = _in_thread(post_json, port, _ask(prompt=SLOW + "x"), timeout=30)
    time.sleep(0.2)  # the slow request is tokenizing
    start = time.monotonic()
    assert _get(port, timeout=30)[0] == 200
    assert time.monotonic() - start < SLOW_SECONDS / 3
    status, body = post_json(port, _ask(max_tokens=4, ignore_eos=True), timeout=30)
    assert status == 200 and time.monotonic() - start < SLOW_SECONDS
    assert slow(timeout=30)[0] == 200
