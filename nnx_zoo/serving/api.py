"""The OpenAI-compatible HTTP app (FastAPI; extra `[serve]`): /v1/completions,
/v1/chat/completions, /v1/models, /health, over a running `Engine`.

Each request becomes n jobs per prompt (choice i of a seeded request draws with seed + i, so
choice 0 is what the same request with n=1 gets). The engine thread sends each job's text
pieces to this request's asyncio queue; the handler streams them as server-sent events
(`data: {chunk}` ... `data: [DONE]`) or gathers them into one response. A client that goes
away (mid-stream or while waiting) has its unfinished jobs cancelled, which frees their
slots at the engine's next turn; nothing else is disturbed.

Errors are OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: 400 for a bad
request (unknown model, a prompt that leaves no room for max_tokens, out-of-range sampling
settings, malformed JSON, a missing field), 503 when the waiting queue is full.
"""

from __future__ import annotations

import asyncio
import functools
import json
import random
import threading
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from nnx_zoo.serving import protocol
from nnx_zoo.serving.engine import Engine
from nnx_zoo.serving.protocol import ApiError, ChatRequest, CompletionRequest
from nnx_zoo.serving.scheduler import QueueFullError, Sampling


def create_app(
    engine: Engine,
    *,
    served_model: str,
    chat_template=None,
    chat_template_error: str | None = None,
) -> FastAPI:
    """`chat_template`: a `nnx_zoo.data.chat.ChatTemplate`, or None (then chat requests get
    a 400 saying `chat_template_error`)."""
    app = FastAPI(title="nnx-zoo", docs_url=None, redoc_url=None)
    tokenizer = engine.tokenizer
    started = int(time.time())
    # n beyond what can ever run or wait at once would be refused by the queue anyway.
    max_n = engine.slots.max_batch + engine.scheduler.max_queue

    @app.exception_handler(ApiError)
    async def api_error(_request, error: ApiError):
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request, error: RequestValidationError):
        return JSONResponse(_validation_body(error), status_code=400)

    @app.get("/health")
    async def health():
        return {"status": "ok", **engine.status()}

    @app.get("/v1/models")
    async def models():
        card = {
            "id": served_model,
            "object": "model",
            "created": started,
            "owned_by": "nnx-zoo",
            "max_model_len": engine.slots.max_seq_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        ask = protocol.check(body, served_model=served_model, max_n=max_n)
        prompts = _completion_prompts(body.prompt, tokenizer)
        envelope = protocol.Envelope(served_model, chat=False)
        return await _serve(engine, request, prompts, ask, envelope, body)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        ask = protocol.check(body, served_model=served_model, max_n=max_n)
        if chat_template is None:
            raise ApiError(chat_template_error or "this model has no chat template")
        if not body.messages:
            raise ApiError("messages must hold at least one message", param="messages")
        messages = [protocol.chat_text(m) for m in body.messages]
        try:
            text = chat_template.render(messages, add_generation_prompt=True)
        except ValueError as e:
            raise ApiError(str(e), param="messages") from None
        envelope = protocol.Envelope(served_model, chat=True)
        return await _serve(engine, request, [tokenizer.encode(text)], ask, envelope, body)

    return app


def _completion_prompts(prompt, tokenizer) -> list[list[int]]:
    """Token ids of each prompt: a string, a list of strings, token ids or lists of them."""
    if isinstance(prompt, str):
        prompts = [tokenizer.encode(prompt)]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [list(prompt)]
    else:
        prompts = [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt]
    if not prompts or any(not p for p in prompts):
        raise ApiError("the prompt is empty", param="prompt")
    return prompts


async def _serve(engine: Engine, request: Request, prompts, ask, envelope, body):
    bridge = _bridge(request)
    events: asyncio.Queue = asyncio.Queue()
    jobs = []
    seed = random.getrandbits(32) if ask.seed is None else ask.seed
    limit = engine.slots.max_seq_len
    for p, prompt in enumerate(prompts):
        for i in range(ask.n):
            index = p * ask.n + i
            sampling = Sampling(ask.temperature, ask.top_k, ask.top_p, (seed + i) % 2**32)
            # No max_tokens (chat): as much as the context leaves (at least one token, so a
            # prompt that fills the context is refused as too long).
            max_tokens = ask.max_tokens or max(limit - len(prompt), 1)
            try:
                job = engine.job(
                    prompt,
                    max_tokens=max_tokens,
                    sampling=sampling,
                    stop=ask.stop,
                    ignore_eos=ask.ignore_eos,
                    on_event=functools.partial(bridge.put, events, index),
                )
            except ValueError as e:
                raise ApiError(str(e), param="messages" if envelope.chat else "prompt") from None
            jobs.append(job)
    try:
        engine.submit(jobs)
    except QueueFullError as e:
        raise ApiError(str(e), status=503, kind="overloaded_error") from None
    prompt_tokens = sum(len(p) for p in prompts)
    watcher = asyncio.ensure_future(_on_disconnect(request, engine, jobs, events))
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        stream = _stream(engine, jobs, events, envelope, prompt_tokens, include_usage, watcher)
        return StreamingResponse(stream, media_type="text/event-stream")
    try:
        texts, reasons = [""] * len(jobs), [None] * len(jobs)
        async for batch in _events(events, len(jobs)):
            for index, event in batch:
                if event.error:
                    raise ApiError(event.error, status=500)
                texts[index] += event.text
                reasons[index] = event.finish_reason
    finally:
        _cancel_unfinished(engine, jobs)
        watcher.cancel()
    completion_tokens = sum(job.stream.num_tokens for job in jobs)
    return envelope.response(texts, reasons, protocol.usage(prompt_tokens, completion_tokens))


class _Bridge:
    """Events from the engine thread into the event loop's queues, one wake-up of the loop
    for all the events of an engine step (not one per token per request)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.lock = threading.Lock()
        self.pending: list = []

    def put(self, events: asyncio.Queue, index: int, event) -> None:
        with self.lock:
            self.pending.append((events, (index, event)))
            if len(self.pending) > 1:  # a flush is already on its way
                return
        try:
            self.loop.call_soon_threadsafe(self._flush)
        except RuntimeError:  # the loop is closed (shutting down): nothing will read these
            with self.lock:
                self.pending.clear()
            raise

    def _flush(self) -> None:
        with self.lock:
            pending, self.pending = self.pending, []
        for events, item in pending:
            events.put_nowait(item)


def _bridge(request: Request) -> _Bridge:
    """The app's bridge into the running event loop."""
    loop, state = asyncio.get_running_loop(), request.app.state
    if getattr(state, "bridge", None) is None or state.bridge.loop is not loop:
        state.bridge = _Bridge(loop)
    return state.bridge


async def _events(events: asyncio.Queue, count: int):
    """Lists of (choice index, event), each what had arrived when the last was read, until
    every choice has finished; stops early when the client went away."""
    remaining = count
    while remaining:
        batch = [await events.get()]
        while not events.empty():
            batch.append(events.get_nowait())
        if any(event is None for _, event in batch):
            return
        yield batch
        remaining -= sum(event.finish_reason is not None for _, event in batch)


def _merged(batch):
    """(index, text, finish_reason, error) per run of one choice's events in `batch`: a
    client that reads slower than tokens come gets them in fewer, longer chunks."""
    out = []
    for index, event in batch:
        if out and out[-1][0] == index and out[-1][2] is None:
            _, text, _, _ = out[-1]
            out[-1] = (index, text + event.text, event.finish_reason, event.error)
        else:
            out.append((index, event.text, event.finish_reason, event.error))
    return out


async def _stream(engine, jobs, events, envelope, prompt_tokens, include_usage, watcher):
    try:
        if envelope.chat:  # OpenAI's first chunk of a choice names the role
            yield "".join(
                _sse(envelope.chunk(index, None, None, role=True)) for index in range(len(jobs))
            )
        async for batch in _events(events, len(jobs)):
            chunks = []
            for index, text, reason, error in _merged(batch):
                if error:
                    yield "".join(chunks) + _sse(protocol.error_body(error, kind="server_error"))
                    return
                chunks.append(_sse(envelope.chunk(index, text, reason)))
            yield "".join(chunks)
        if include_usage:
            completion_tokens = sum(job.stream.num_tokens for job in jobs)
            yield _sse(envelope.usage_chunk(protocol.usage(prompt_tokens, completion_tokens)))
        yield "data: [DONE]\n\n"
    finally:
        _cancel_unfinished(engine, jobs)
        watcher.cancel()


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _on_disconnect(request: Request, engine, jobs, events: asyncio.Queue) -> None:
    """Wait for the client to go away; then cancel its jobs and end its event stream. (A
    server may stop reading a streamed response's socket without noticing; this does not
    depend on the next write failing.)"""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    _cancel_unfinished(engine, jobs)
    events.put_nowait((None, None))


def _cancel_unfinished(engine: Engine, jobs) -> None:
    for job in jobs:
        if not job.finished:
            engine.cancel(job)


def _validation_body(error: RequestValidationError) -> dict:
    """One message for FastAPI's list of validation errors (malformed JSON among them)."""
    first = error.errors()[0] if error.errors() else {}
    where = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
    kind = first.get("type", "")
    if kind == "json_invalid":  # its loc is a character offset, not a field
        return protocol.error_body(f"the request body is not valid JSON ({first.get('msg', '')})")
    elif kind == "missing":
        message = f"missing required field {where!r}"
    else:
        message = f"{where or 'body'}: {first.get('msg', 'invalid')}"
    return protocol.error_body(message, param=where or None)
