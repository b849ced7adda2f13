"""Log probabilities from the server (issue 50.2): `logprobs` and `echo` on /v1/completions,
`logprobs` / `top_logprobs` on chat.

The reference is the model's own forward pass over the whole sequence (log_softmax of its
float32 logits), not the serving programs: every echoed prompt token's and every generated
token's log-probability, and the top-k, equal it. Then lm-eval's `local-completions` model
against the served checkpoint (a Hugging Face directory with its tokenizer) gives the same
acc / acc_norm, per-request log-likelihoods (within 1e-4) and generations as
`eval_main --tasks` on the same directory."""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import _entry
import jax
import numpy as np
import pytest
import requests

from bench.fixtures import ROOT, TASKS, write_tiny_llama
from nnx_zoo.evaluation.model import LoadRequest
from nnx_zoo.serving import load
from nnx_zoo.serving.logprobs import top_key

pytest.importorskip("lm_eval", reason="the [eval] extra (lm-eval) is not installed")
uvicorn = pytest.importorskip("uvicorn", reason="the [serve] extra is not installed")

MAX_SEQ_LEN = 64
NAME = "tiny-llama"
TEMPLATE = os.path.join(ROOT, "tests", "chat_templates", "qwen3.jinja")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp(NAME))
    write_tiny_llama(directory, "llama", max_seq_len=MAX_SEQ_LEN)
    return directory


@pytest.fixture(scope="module")
def served(hf_dir):
    """serve_main's engine and app over the HF directory, in this process (its default
    layout: fsdp_tp over the 8 devices, as eval_main's), on a free port."""
    from nnx_zoo.serving.api import create_app

    request = load.ServeRequest(
        load=LoadRequest(workdir=None, hf_checkpoint=hf_dir),
        max_batch=4,
        max_seq_len=MAX_SEQ_LEN,
        max_queue=64,
        chat_template=TEMPLATE,
        served_model_name=NAME,
        warmup=False,
    )
    serving = load.build(request)
    app = create_app(
        serving.engine,
        served_model=NAME,
        chat_template=serving.chat_template,
        chat_template_error=serving.chat_template_error,
    )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    port = sock.getsockname()[1]
    serving.engine.start()
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started
    serving.url = f"http://127.0.0.1:{port}/v1"
    yield serving
    server.should_exit = True
    thread.join(10)
    serving.engine.stop()
    sock.close()


def post(served, path: str, body: dict) -> tuple[int, dict]:
    answer = requests.post(f"{served.url}/{path}", json={"model": NAME, **body}, timeout=120)
    return answer.status_code, answer.json()


@pytest.fixture(scope="module")
def reference(hf_dir):
    """log_softmax of the model's float32 logits over a whole sequence, [T, V] (one device,
    the model's own forward pass: not the serving programs)."""
    from shardings import get_strategy
    from zoo import from_pretrained

    strategy = get_strategy("fsdp_tp")
    mesh = strategy.make_mesh(shape=(1, 1), devices=jax.devices()[:1])
    with jax.set_mesh(mesh):
        model = from_pretrained(hf_dir, strategy)

    def logprobs(ids):
        T = len(ids)
        with jax.set_mesh(mesh):
            logits = model(
                np.asarray([ids], np.int32),
                segment_ids=np.ones((1, T), np.int32),
                positions=np.arange(T, dtype=np.int32)[None],
            )
        return np.asarray(jax.nn.log_softmax(np.asarray(logits, np.float32), axis=-1))[0]

    return logprobs


def test_echo_scores_the_prompt_and_each_generated_token(served, reference):
    tokenizer = served.engine.tokenizer
    prompt = tokenizer.encode("Question: The opposite of hot is\nAnswer:")
    k = 3
    status, body = post(
        served,
        "completions",
        dict(prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=k, ignore_eos=True),
    )
    assert status == 200, body
    choice = body["choices"][0]
    lp = choice["logprobs"]
    n = len(prompt)
    assert len(lp["token_logprobs"]) == n + 4
    # The ids the server drew (greedy: the same again, from the engine itself).
    drawn = served.engine.generate([prompt], max_tokens=4, ignore_eos=True)[0]
    assert choice["text"] == tokenizer.decode(prompt) + drawn.text
    ids = [*prompt, *drawn.ids]
    want = reference(ids)
    # The first prompt token: nothing predicts it (OpenAI's null).
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    got = np.asarray(lp["token_logprobs"][1:])
    np.testing.assert_allclose(got, [want[t - 1, ids[t]] for t in range(1, len(ids))], atol=1e-4)
    for t in range(1, len(ids)):
        top = lp["top_logprobs"][t]
        order = np.argsort(-want[t - 1])[:k]
        keys = [top_key(tokenizer.decode([int(i)]), int(i)) for i in order]
        for key, i in zip(keys, order, strict=True):
            assert top[key] == pytest.approx(want[t - 1, i], abs=1e-4)
        assert set(top) <= {*keys, top_key(tokenizer.decode([ids[t]]), ids[t])}
    # Greedy: each generated token is the most likely one.
    for t in range(n, len(ids)):
        assert lp["token_logprobs"][t] == max(lp["top_logprobs"][t].values())
    # Offsets index the echoed text.
    text = choice["text"]
    for token, at in zip(lp["tokens"], lp["text_offset"], strict=True):
        assert text[at : at + len(token)] == token
    assert "".join(lp["tokens"]) == text


LIMIT = 6  # examples per task: 24 loglikelihood requests (4 choices each), 6 generations
TASK_NAMES = ["zoo_facts", "zoo_facts_gen"]


def test_lm_eval_local_completions_equals_eval_main_tasks(served, hf_dir, tmp_path, monkeypatch):
    """The goal of issue 50.2: lm-eval's `local-completions` model against the server gives
    eval_main --tasks' acc / acc_norm (a loglikelihood task) and exact_match (a generation
    task) on the same checkpoint, each request's log-likelihood within 1e-4 and the same
    greedy flags and generated texts. (The server is sent token ids, BOS added as the
    tokenizer adds it: eval_main's hf-backend conventions, nnx_zoo/evaluation/harness_tokens.)"""
    # lm-eval's API models tokenize with transformers (a peer, on CI's floor leg only).
    pytest.importorskip("transformers", reason="transformers (lm-eval's tokenizer) is missing")
    import lm_eval
    from lm_eval.tasks import TaskManager

    from nnx_zoo.evaluation import harness

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    served_results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=dict(
            model=NAME,
            base_url=f"{served.url}/completions",
            tokenizer=hf_dir,
            tokenizer_backend="huggingface",
            tokenized_requests=True,
            add_bos_token=True,
            max_retries=1,
        ),
        tasks=TASK_NAMES,
        task_manager=TaskManager(include_path=TASKS, include_defaults=False),
        limit=LIMIT,
        log_samples=True,
    )

    # eval_main --tasks in this process; its harness run keeps its samples for the comparison.
    kept = {}
    run_tasks = harness.run_tasks

    def run_tasks_logged(*args, **kwargs):
        kept["results"] = run_tasks(*args, **{**kwargs, "log_samples": True})
        return kept["results"]

    monkeypatch.setattr(harness, "run_tasks", run_tasks_logged)
    proc = _entry.evaluate(
        [
            f"--workdir={tmp_path}",
            f"--hf_checkpoint={hf_dir}",
            f"--tasks={','.join(TASK_NAMES)}",
            f"--include_path={TASKS}",
            f"--limit={LIMIT}",
        ]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(tmp_path / "lm_eval.json") as f:
        written = json.load(f)["results"]
    ours = kept["results"]

    for task, metrics in (("zoo_facts", ("acc", "acc_norm")), ("zoo_facts_gen", ("exact_match",))):
        for metric in metrics:
            key = f"{metric},none" if task == "zoo_facts" else f"{metric},strip"
            assert served_results["results"][task][key] == written[task][key], (task, key)

    def by_doc(results, task):
        return {s["doc_id"]: s for s in results["samples"][task]}

    served_facts, our_facts = by_doc(served_results, "zoo_facts"), by_doc(ours, "zoo_facts")
    assert sorted(served_facts) == sorted(our_facts) and len(our_facts) == LIMIT
    for doc_id, sample in our_facts.items():
        theirs = served_facts[doc_id]
        assert [a["arguments"] for a in [sample]] == [theirs["arguments"]]
        want = [r[0] for r in sample["resps"]]  # (log-likelihood, is_greedy) per choice
        got = [r[0] for r in theirs["resps"]]
        np.testing.assert_allclose([g[0] for g in got], [w[0] for w in want], atol=1e-4)
        assert [g[1] for g in got] == [w[1] for w in want]
    served_gen, our_gen = by_doc(served_results, "zoo_facts_gen"), by_doc(ours, "zoo_facts_gen")
    assert {d: s["resps"] for d, s in served_gen.items()} == {
        d: s["resps"] for d, s in our_gen.items()
    }
    assert any(s["resps"][0][0].strip() for s in our_gen.values())  # something was generated


def test_chat_logprobs_and_what_is_refused(served, reference):
    tokenizer = served.engine.tokenizer
    messages = [{"role": "user", "content": "The opposite of hot is"}]
    status, body = post(
        served,
        "chat/completions",
        dict(messages=messages, max_tokens=3, temperature=0, logprobs=True, top_logprobs=2),
    )
    assert status == 200, body
    choice = body["choices"][0]
    content = choice["logprobs"]["content"]
    assert "".join(c["token"] for c in content) == choice["message"]["content"]
    for c in content:
        assert c["bytes"] == list(c["token"].encode("utf-8"))
        assert len(c["top_logprobs"]) == 2
        # Greedy: the token is the most likely one, with its log-probability.
        assert c["logprob"] == c["top_logprobs"][0]["logprob"] <= 0
    # Without logprobs: none.
    status, body = post(served, "chat/completions", dict(messages=messages, max_tokens=2))
    assert status == 200 and body["choices"][0]["logprobs"] is None
    # max_tokens 0 with echo: the prompt scored, nothing generated.
    prompt = "Question: The opposite of up is\nAnswer: down"
    status, body = post(
        served, "completions", dict(prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    )
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 0
    ids = tokenizer.encode(prompt)
    want = reference(ids)
    lp = choice["logprobs"]
    assert lp["tokens"] == [
        tokenizer.decode(ids[: t + 1])[len(tokenizer.decode(ids[:t])) :] for t in range(len(ids))
    ]
    np.testing.assert_allclose(
        lp["token_logprobs"][1:], [want[t - 1, ids[t]] for t in range(1, len(ids))], atol=1e-4
    )
    # logprobs 0: each top_logprobs holds the token alone.
    assert all(len(top) == 1 for top in lp["top_logprobs"][1:])
    bad = [
        ("completions", dict(prompt="a", logprobs=True), "logprobs", "not a boolean"),
        ("completions", dict(prompt="a", logprobs=1, stream=True), "logprobs", "with stream"),
        ("completions", dict(prompt="a", echo=True, stream=True), "echo", "with stream"),
        ("chat/completions", dict(messages=messages, logprobs=2), "logprobs", "true or false"),
        ("chat/completions", dict(messages=messages, top_logprobs=2), "top_logprobs", "needs"),
        (
            "chat/completions",
            dict(messages=messages, logprobs=True, top_logprobs=21),
            "top_logprobs",
            "[0, 20]",
        ),
    ]
    for path, fields, param, message in bad:
        status, body = post(served, path, fields)
        assert status == 400 and body["error"]["param"] == param, (fields, body)
        assert message in body["error"]["message"], body
