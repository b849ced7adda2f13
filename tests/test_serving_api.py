"""serve_main.py as a user runs it: one server process on a free port (the HTTP process is
the subject), serving a tiny checkpoint, driven with the official `openai` client (and httpx
for what a client library would not send): completion and chat, streamed and not; greedy
output equals eval_main --prompt; 8 concurrent streams of different lengths get the tokens
each gets alone; seeded sampling alone and batched; stop strings, n, usage; every bad input
a 400 with OpenAI's error JSON and the next request served; a full queue a 503; a client
that drops mid-stream frees its slot, and 8 requests then run at once."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import re
import select
import subprocess
import sys
import time

import _entry
import jax
import openai
import optax
import pytest
from _serving_helpers import perturbed_model
from _train_helpers import ROOT, child_env
from flax import nnx
from model_utils import save_as_run

import configs.tiny
from nnx_zoo.data.chat import ChatTemplate
from nnx_zoo.training.config import RunConfig
from shardings import get_strategy

NAME = "tiny-served"
MAX_BATCH = 8
MAX_SEQ_LEN = 128  # buckets 16, 32, 64, 128
MAX_QUEUE = 8
TEMPLATE = os.path.join(ROOT, "tests", "chat_templates", "qwen3.jinja")
# Different lengths, in the prefill buckets 16 and 32 (chat's rendered prompt: 64).
PROMPTS = [
    "def main(",
    "import os",
    "x = [i * i for i in range(",
    "The",
    "class Engine:\n    def run(",
    "print('hello, world')",
    "for k in sorted(d):\n    ",
    "# a comment, then code\nwhile",
]
NEW = 16
LONG = 96  # tokens of the requests that must overlap: every prompt here + LONG fits


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A tiny model, perturbed away from its init (varied greedy tokens), checkpointed at
    step 3 on one device; eval_main reloads it on 8 (dp), the server on one."""
    workdir = str(tmp_path_factory.mktemp("serve") / NAME)
    c = configs.tiny.get_config()
    c.model.hidden_dim, c.model.num_layers, c.model.head_dim, c.model.ffn_dim = 64, 2, 8, 128
    c.data.seq_len, c.data.global_batch_size = 64, 8
    run = RunConfig.from_config_dict(c)
    strategy = get_strategy("fsdp_tp")
    mesh = strategy.make_mesh(shape=(1, 1), devices=jax.devices()[:1])
    model = perturbed_model(run.model.decoder_config(), strategy, mesh)
    with jax.set_mesh(mesh):
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    save_as_run(workdir, run, mesh, model, optimizer)
    return workdir


class Server:
    def __init__(self, proc, url, log):
        self.proc, self.url, self.log = proc, url, log
        self.client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)
        self.address = re.match(r"http://([^:/]+):(\d+)", url).groups()

    def connect(self) -> http.client.HTTPConnection:
        host, port = self.address
        return http.client.HTTPConnection(host, int(port), timeout=120)

    def health(self) -> dict:
        connection = self.connect()
        connection.request("GET", "/health")
        return json.loads(connection.getresponse().read())

    def post(self, path: str, body) -> tuple[int, dict]:
        """Raw POST (what a client library would not send): (status, JSON body)."""
        content = body if isinstance(body, str) else json.dumps(body)
        connection = self.connect()
        try:
            headers = {"content-type": "application/json"}
            connection.request("POST", f"/v1/{path}", body=content.encode(), headers=headers)
            response = connection.getresponse()
            return response.status, json.loads(response.read())
        finally:
            connection.close()


@pytest.fixture(scope="module")
def server(workdir, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("serve-log") / "stderr.txt"
    log = open(log_path, "w+")  # noqa: SIM115 -- read back on failure, closed at teardown
    proc = subprocess.Popen(
        [
            sys.executable,
            "serve_main.py",
            f"--workdir={workdir}",
            "--port=0",
            f"--max_batch={MAX_BATCH}",
            f"--max_seq_len={MAX_SEQ_LEN}",
            f"--max_queue={MAX_QUEUE}",
            f"--chat_template={TEMPLATE}",
            "--nowarmup",  # compile on first use: only the buckets the tests reach
        ],
        cwd=ROOT,
        env=child_env(1),
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
    )
    # The platform line (nnx_zoo/runtime/host.py), then the one saying it is ready.
    lines, deadline = [], time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None and len(lines) < 2:
        if select.select([proc.stdout], [], [], 1.0)[0]:
            lines.append(proc.stdout.readline())
    found = re.match(r"serving (\S+) on (http://\S+/v1) ", lines[-1] if lines else "")
    if not found:
        proc.kill()
        log.seek(0)
        pytest.fail(f"the server did not start: {lines!r}\n{log.read()[-3000:]}")
    assert lines[0].startswith("jax ") and lines[0].endswith(" on cpu: 1 x cpu device\n"), lines
    assert found.group(1) == NAME  # the workdir's name by default
    server = Server(proc, found.group(2), log)
    # Before any test's request (the tests run in any order).
    server.first_health = server.health()
    yield server
    proc.terminate()
    assert proc.wait(timeout=60) == 0 or proc.returncode == -15
    log.close()


def _generated(stdout: str, prompt: str) -> str:
    """What eval_main --prompt generated: it prints the platform line, then prompt + text."""
    platform, printed = stdout.split("\n", 1)
    assert platform.startswith("jax ") and " on cpu: " in platform, stdout
    assert printed.startswith(prompt), stdout
    return printed[len(prompt) : -1]


def _complete(server, prompt, **kwargs):
    kwargs = {"max_tokens": NEW, "temperature": 0, **kwargs}
    return server.client.completions.create(model=NAME, prompt=prompt, **kwargs)


def _stream_text(server, prompt, **kwargs):
    """(text, finish_reason, usage, [chunk times]) of a streamed completion."""
    kwargs = {"max_tokens": NEW, "temperature": 0, **kwargs}
    stream = server.client.completions.create(
        model=NAME, prompt=prompt, stream=True, stream_options={"include_usage": True}, **kwargs
    )
    text, reason, usage, times = "", None, None, []
    for chunk in stream:
        times.append(time.monotonic())
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.text
            reason = choice.finish_reason or reason
    return text, reason, usage, times


def test_models_and_health(server):
    models = server.client.models.list()
    assert [m.id for m in models.data] == [NAME]
    health = server.health()
    assert health["status"] == "ok" and health["max_batch"] == MAX_BATCH
    # --nowarmup: nothing compiled before the first request
    assert server.first_health["traces"] == {}


def test_greedy_equals_eval_main_streamed_and_not(server, workdir):
    for prompt in PROMPTS[:1]:  # (the engine's tests: zoo.generate on more)
        result = _entry.evaluate(
            [
                f"--workdir={workdir}",
                "--noevaluate",
                f"--prompt={prompt}",
                f"--max_new_tokens={NEW}",
                "--sharding_strategy=dp",  # each device a whole row: one device's numbers
            ]
        )
        assert result.returncode == 0, result.stderr[-2000:]
        want = _generated(result.stdout, prompt)
        response = _complete(server, prompt)
        choice = response.choices[0]
        assert choice.text == want
        # (Bytes of a random model's text need not be valid UTF-8: count tokens, not text.)
        assert (choice.finish_reason == "length") == (response.usage.completion_tokens == NEW)
        assert response.usage.prompt_tokens == len(prompt.encode())
        text, reason, usage, _ = _stream_text(server, prompt)
        assert (text, reason) == (want, choice.finish_reason)
        assert usage.completion_tokens == response.usage.completion_tokens


def test_a_seeded_sample_is_the_same_text_from_eval_main_and_the_server(server, workdir):
    # One sampler (zoo/sampling.py) keyed by seed and position: the seed, not the program
    # that draws, decides the text.
    prompt, seed = PROMPTS[2], 1234
    result = _entry.evaluate(
        [
            f"--workdir={workdir}",
            "--noevaluate",
            f"--prompt={prompt}",
            f"--max_new_tokens={NEW}",
            "--temperature=0.9",
            "--top_k=50",
            f"--seed={seed}",
            "--sharding_strategy=dp",
        ]
    )
    assert result.returncode == 0, result.stderr[-2000:]
    want = _generated(result.stdout, prompt)
    greedy = _complete(server, prompt).choices[0].text
    sampled = _complete(server, prompt, temperature=0.9, seed=seed, extra_body={"top_k": 50})
    assert sampled.choices[0].text == want
    assert want != greedy  # the draw did something


def test_chat_streamed_and_not_equals_the_rendered_template(server):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say hi."},
    ]
    with open(TEMPLATE, encoding="utf-8") as f:
        rendered = ChatTemplate(f.read()).render(messages, add_generation_prompt=True)
    want = _complete(server, rendered).choices[0].text
    response = server.client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=NEW, temperature=0
    )
    assert response.object == "chat.completion"
    assert response.choices[0].message.role == "assistant"
    assert response.choices[0].message.content == want
    assert response.usage.prompt_tokens == len(rendered.encode())
    stream = server.client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=NEW, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == response.choices[0].finish_reason


def test_eight_concurrent_streams_get_their_own_tokens(server):
    alone = [_complete(server, p, max_tokens=24 + 8 * i) for i, p in enumerate(PROMPTS)]
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(
            pool.map(
                lambda ip: _stream_text(server, ip[1], max_tokens=24 + 8 * ip[0]),
                enumerate(PROMPTS),
            )
        )
    for response, (text, reason, usage, _) in zip(alone, results, strict=True):
        assert text == response.choices[0].text
        assert reason == response.choices[0].finish_reason
        assert usage.completion_tokens == response.usage.completion_tokens


def test_seeded_sampling_same_alone_and_batched_and_n(server):
    settings = dict(temperature=0.9, top_p=0.95, seed=42, max_tokens=24, extra_body={"top_k": 40})
    alone = _complete(server, PROMPTS[0], **settings).choices[0].text
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        others = [
            pool.submit(_complete, server, p, temperature=1.2, seed=i, max_tokens=40)
            for i, p in enumerate(PROMPTS[1:4])
        ]
        batched = pool.submit(_complete, server, PROMPTS[0], **settings)
        [f.result() for f in others]
        assert batched.result().choices[0].text == alone
    two = _complete(server, PROMPTS[0], n=2, **settings)
    assert [c.index for c in two.choices] == [0, 1]
    assert two.choices[0].text == alone  # choice i draws with seed + i
    assert two.usage.prompt_tokens == len(PROMPTS[0].encode())
    other_seed = _complete(server, PROMPTS[0], **{**settings, "seed": 43}).choices[0].text
    assert other_seed != alone


def _stop_candidate(text: str) -> str | None:
    """A stop string from the middle of `text`, first seen there, of whole characters (a
    random model's bytes are often not UTF-8: U+FFFD)."""
    for n in (3, 2, 1):
        for i in range(2, len(text) - n):
            if "\ufffd" not in text[i : i + n] and text.find(text[i : i + n]) == i:
                return text[i : i + n]
    return None


def test_stop_strings(server):
    for prompt in PROMPTS:
        text = _complete(server, prompt, max_tokens=40, extra_body={"ignore_eos": True})
        text = text.choices[0].text
        if stop := _stop_candidate(text):
            break
    assert stop, "no prompt gave text with a stop string to cut at"
    cut = _complete(server, prompt, max_tokens=40, stop=["\x00never", stop])
    assert cut.choices[0].text == text[: text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed, reason, _, _ = _stream_text(server, prompt, max_tokens=40, stop=stop)
    assert (streamed, reason) == (text[: text.find(stop)], "stop")


GOOD = {"model": NAME, "prompt": "def", "max_tokens": 2, "temperature": 0}


def raw(fields: str) -> str:
    """A body with `fields` appended as written (what JSON cannot hold, or malformed)."""
    return '{"model": "' + NAME + '", "prompt": "a"' + fields + "}"


@pytest.mark.parametrize(
    "body, param, message",
    [
        ({**GOOD, "model": "gpt-4"}, "model", "does not exist"),
        ({**GOOD, "prompt": "x" * (MAX_SEQ_LEN - 1)}, "prompt", "maximum context length"),
        ({**GOOD, "max_tokens": MAX_SEQ_LEN}, "prompt", "maximum context length"),
        ({**GOOD, "max_tokens": 0}, "max_tokens", "must be >= 1 (0 only with echo"),
        ({**GOOD, "temperature": -0.5}, "temperature", "finite number >= 0"),
        (raw(', "temperature": NaN'), "temperature", "finite"),
        (raw(', "temperature": Infinity'), "temperature", "finite"),
        ({**GOOD, "top_p": 0}, "top_p", "in (0, 1]"),
        ({**GOOD, "top_p": 1.5}, "top_p", "in (0, 1]"),
        ({**GOOD, "n": 0}, "n", "n=0"),
        ({**GOOD, "logprobs": 21}, "logprobs", "must be in [0, 20]"),
        ({**GOOD, "prompt": ""}, "prompt", "empty"),
        ({**GOOD, "prompt": [1, 99999]}, "prompt", "outside the vocabulary"),
        ({"model": NAME}, "prompt", "missing required field"),
        ({**GOOD, "max_tokens": "many"}, "max_tokens", "integer"),
        (raw("")[:-1], None, "not valid JSON"),
        ("[1, 2]", None, ""),
    ],
    ids=[
        "unknown-model",
        "prompt-too-long",
        "no-room-for-max-tokens",
        "max-tokens-0",
        "temperature-negative",
        "temperature-nan",
        "temperature-inf",
        "top-p-0",
        "top-p-above-1",
        "n-0",
        "logprobs-above-20",
        "empty-prompt",
        "token-outside-vocab",
        "no-prompt",
        "max-tokens-not-int",
        "malformed-json",
        "not-an-object",
    ],
)
def test_bad_input_is_a_400_and_the_server_goes_on(server, body, param, message):
    status, answer = server.post("completions", body)
    assert status == 400, answer
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert message in error["message"]
    status, good = server.post("completions", GOOD)
    assert status == 200 and good["choices"][0]["finish_reason"]


def test_chat_bad_input_and_unknown_fields_ignored(server):
    status, bad = server.post("chat/completions", {"model": NAME, "messages": []})
    assert status == 400 and "at least one message" in bad["error"]["message"]
    # Fields OpenAI may add, or a client's own, are ignored as OpenAI ignores them.
    status, ok = server.post(
        "chat/completions",
        {
            "model": NAME,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "max_tokens": 3,
            "temperature": 0,
            "some_future_field": {"x": 1},
            "user": "me",
        },
    )
    assert status == 200, ok
    with pytest.raises(openai.BadRequestError, match="does not exist"):
        server.client.chat.completions.create(
            model="nope", messages=[{"role": "user", "content": "hi"}]
        )


def test_full_queue_is_a_503_and_clients_that_leave_free_their_slots(server):
    long = {**GOOD, "max_tokens": LONG, "ignore_eos": True}
    before = server.health()
    # More than the slots and the queue hold, all at once: the excess is refused (503) and
    # the rest all finish.
    with concurrent.futures.ThreadPoolExecutor(24) as pool:
        statuses = [s for s, _ in pool.map(lambda _: server.post("completions", long), range(24))]
    assert 503 in statuses and statuses.count(200) >= MAX_BATCH + MAX_QUEUE, statuses
    assert set(statuses) == {200, 503}
    assert server.post("completions", long)[0] == 200  # idle again: served

    # A client that drops its stream after its first chunk: its slot is freed (cancelled),
    # long before its tokens would all have been generated.
    connection = server.connect()
    body = json.dumps({**long, "stream": True}).encode()
    connection.request(
        "POST", "/v1/completions", body=body, headers={"content-type": "application/json"}
    )
    response = connection.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: ")
    connection.close()
    deadline = time.monotonic() + 30
    while (health := server.health())["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert health["running"] == 0 and health["waiting"] == 0
    assert health["cancelled"] == before["cancelled"] + 1

    # Every slot is free: 8 streams all get their first token before any of them ends.
    with concurrent.futures.ThreadPoolExecutor(MAX_BATCH) as pool:
        results = list(
            pool.map(
                lambda p: _stream_text(server, p, max_tokens=LONG, extra_body={"ignore_eos": True}),
                PROMPTS,
            )
        )
    first_chunks = [times[0] for *_, times in results]
    last_chunks = [times[-1] for *_, times in results]
    assert max(first_chunks) < min(last_chunks)
    assert all(usage.completion_tokens == LONG for _, _, usage, _ in results)
    assert server.health()["peak_running"] == MAX_BATCH


def test_the_server_is_still_up_and_compiled_once_per_bucket(server):
    assert server.proc.poll() is None
    for length in (3, 20, 40):  # one prompt in each of the buckets 16, 32, 64
        assert _complete(server, "x" * length).choices[0].finish_reason in ("stop", "length")
    # Every request so far (hundreds, of many lengths) ran on one decode program and one
    # prefill program per length bucket it reached.
    traces = server.health()["traces"]
    assert traces["decode"] == 1 and set(traces.values()) == {1}
    assert (
        {"prefill 16", "prefill 32", "prefill 64"}
        <= set(traces)
        <= {
            "decode",
            *(f"prefill {b}" for b in (16, 32, 64, 128)),
        }
    )


def _serve_main(*flags) -> _entry.Result:
    """serve_main in-process, for command lines that must fail before anything listens."""
    return _entry.run_main("serve_main", list(flags))


@pytest.mark.parametrize(
    "flags, message",
    [
        ([], "give one of --workdir"),
        (["--workdir=/nonexistent/run"], "/nonexistent/run"),
        (["WORKDIR", "--max_batch=0"], "--max_batch=0 must be >= 1"),
        (["WORKDIR", "--max_batch=3", "--sharding_strategy=dp"], "must be a multiple of 8"),
        (["WORKDIR", "--max_seq_len=4096"], "exceeds the model's max_seq_len=256"),
        (["WORKDIR", "--sharding_strategy=fsdp_pp"], "does not run under the pipeline"),
        (["WORKDIR", "--chat_template=/nonexistent.jinja"], "--chat_template"),
        (["WORKDIR", "--port=70000"], "--port=70000"),
        (["WORKDIR", "--lora=fold"], "--lora"),
        (["WORKDIR", "--max_request_bytes=0"], "--max_request_bytes=0 must be >= 1"),
    ],
    ids=[
        "no-model",
        "no-such-workdir",
        "max-batch-0",
        "max-batch-not-splitting",
        "max-seq-len-past-model",
        "pipeline-strategy",
        "no-such-template",
        "bad-port",
        "bad-lora",
        "max-request-bytes-0",
    ],
)
def test_bad_command_line_exits_2_with_one_line(workdir, flags, message):
    flags = [f"--workdir={workdir}" if f == "WORKDIR" else f for f in flags]
    result = _serve_main("--port=0", *flags)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr


def test_a_port_in_use_exits_2_before_loading(workdir):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        result = _serve_main(f"--workdir={workdir}", f"--port={port}")
    assert result.returncode == 2
    assert (
        result.stderr.strip()
        == f"error: cannot listen on 127.0.0.1:{port} (Address already in use)"
    )


def test_help_exits_0():
    result = _serve_main("--help")
    assert result.returncode == 0 and "--max_batch" in result.stdout
