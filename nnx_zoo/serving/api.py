"""The OpenAI-compatible HTTP app (FastAPI; extra `[serve]`): /v1/completions,
/v1/chat/completions, /v1/models, /health, over a running `Engine`.

Each request becomes n jobs per prompt (choice i of a seeded request draws with seed + i, so
choice 0 is what the same request with n=1 gets). The engine thread sends each job's text
pieces to this request's asyncio queue; the handler streams them as server-sent events
(`data: {chunk}` ... `data: [DONE]`) or gathers them into one response. A client that goes
away (mid-stream or while waiting) has its unfinished jobs cancelled, which frees their
slots at the engine's next turn; nothing else is disturbed.

The event loop only moves bytes: a request body is read with a bound (413 past
`max_request_bytes`, said by its Content-Length before any of it is read, or counted as it
streams in), and parsed, checked, rendered and tokenized on a worker thread, so a long prompt
never holds up the streams of the others.

Errors are OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: 400 for a bad
request (unknown model, a prompt that leaves no room for max_tokens, out-of-range sampling
settings, more prompts x n than the server can ever hold, too many or too long stop strings,
malformed JSON, a missing field), 413 for a body past the limit, 503 when the waiting queue is
full now, 500 when the engine failed the request (with the cause) or has stopped (then
`/health` answers 503 too).
"""

from __future__ import annotations

import asyncio
import functools
import json
import random
import threading
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from nnx_zoo.serving import logprobs, protocol
from nnx_zoo.serving.engine import Engine, EngineStoppedError
from nnx_zoo.serving.protocol import ApiError, ChatRequest, CompletionRequest
from nnx_zoo.serving.scheduler import Event, QueueFullError, Sampling

# A request body past this is refused (413) unread. A request holds at most --max_batch +
# --max_queue prompts of at most --max_seq_len tokens; 2 MiB is ~500k tokens of English
# text, or ~250k token ids: the default server's largest request with room to spare, and
# small enough that parsing one holds the interpreter only briefly (docs/serving.md).
DEFAULT_MAX_REQUEST_BYTES = 2 << 20
# How often a waiting request looks at whether the engine still runs.
_ENGINE_CHECK_SECONDS = 0.5


def create_app(
    engine: Engine,
    *,
    served_model: str,
    chat_template=None,
    chat_template_error: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
) -> FastAPI:
    """`chat_template`: a `nnx_zoo.data.chat.ChatTemplate`, or None (then chat requests get
    a 400 saying `chat_template_error`)."""
    app = FastAPI(title="nnx-zoo", docs_url=None, redoc_url=None)
    tokenizer = engine.tokenizer
    # A tokenizer that can let the other threads run while it works (the engine's among them).
    encode = getattr(tokenizer, "encode_concurrently", tokenizer.encode)
    started = int(time.time())
    capacity = engine.scheduler.capacity

    @app.exception_handler(ApiError)
    async def api_error(_request, error: ApiError):
        return JSONResponse(error.body(), status_code=error.status)

    @app.get("/health")
    async def health():
        status = engine.status()
        if status["stopped"] is not None:
            return JSONResponse({"status": "error", **status}, status_code=503)
        return {"status": "ok", **status}

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

    def completion_jobs(raw: bytes, on_event):
        body = protocol.parse(raw, CompletionRequest)
        ask = protocol.check(body, served_model=served_model, capacity=capacity)
        given = protocol.prompts(body.prompt)
        _check_fits(len(given), ask.n, capacity)  # before tokenizing them all
        prompts = [encode(p) if isinstance(p, str) else p for p in given]
        if not prompts or any(not p for p in prompts):
            raise ApiError("the prompt is empty", param="prompt")
        envelope = protocol.Envelope(served_model, chat=False)
        jobs = _jobs(engine, prompts, ask, envelope, on_event)

        def finish(texts: list[str]):
            """(texts, logprobs) of the choices: with echo, each prompt prepended (a string
            as sent, token ids decoded)."""
            echoed = [None] * len(jobs)
            if ask.echo:
                shown = [p if isinstance(p, str) else tokenizer.decode(p) for p in given]
                echoed = [shown[i // ask.n] for i in range(len(jobs))]
            lps = None
            if ask.logprobs is not None:
                lps = [
                    logprobs.completion(job, text, prompt)
                    for job, text, prompt in zip(jobs, texts, echoed, strict=True)
                ]
            return [(p or "") + t for p, t in zip(echoed, texts, strict=True)], lps

        return body, envelope, prompts, jobs, finish

    def chat_jobs(raw: bytes, on_event):
        body = protocol.parse(raw, ChatRequest)
        ask = protocol.check(body, served_model=served_model, capacity=capacity)
        if chat_template is None:
            raise ApiError(chat_template_error or "this model has no chat template")
        if not body.messages:
            raise ApiError("messages must hold at least one message", param="messages")
        messages = [protocol.chat_text(m) for m in body.messages]
        try:
            text = chat_template.render(messages, add_generation_prompt=True)
        except ValueError as e:
            raise ApiError(str(e), param="messages") from None
        prompts = [encode(text)]
        envelope = protocol.Envelope(served_model, chat=True)
        jobs = _jobs(engine, prompts, ask, envelope, on_event)

        def finish(texts: list[str]):
            if ask.logprobs is None:
                return texts, None
            return texts, [logprobs.chat(job, t) for job, t in zip(jobs, texts, strict=True)]

        return body, envelope, prompts, jobs, finish

    async def serve(request: Request, make_jobs):
        raw = await _read_body(request, max_request_bytes)
        events: asyncio.Queue = asyncio.Queue()
        on_event = functools.partial(_bridge(request).put, events)
        # Parsing, the template and the tokenizer run beside the event loop (and, for a
        # tokenizer that lets go of the interpreter, beside the engine thread).
        made = await asyncio.to_thread(make_jobs, raw, on_event)
        return await _serve(engine, request, *made, events)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serve(request, completion_jobs)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await serve(request, chat_jobs)

    return app


async def _read_body(request: Request, limit: int) -> bytes:
    """The request's body, or ApiError(413) past `limit` bytes: by its Content-Length before
    anything is read, or as it arrives (a chunked body, or one longer than it said)."""
    too_large = ApiError(
        f"the request body is larger than this server's limit of {limit} bytes "
        "(serve_main --max_request_bytes)",
        status=413,
        code="request_too_large",
    )
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise ApiError(f"Content-Length {declared!r} is not a number of bytes")
        if int(declared) > limit:
            raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def _check_fits(prompts: int, n: int, capacity: int) -> None:
    if prompts * n > capacity:
        raise ApiError(
            f"this request asks for {prompts} prompts x n={n} = {prompts * n} sequences; this "
            f"server holds at most {capacity} at once (--max_batch + --max_queue), so it could "
            "never be admitted: send fewer prompts, or a smaller n",
            param="n" if prompts == 1 else "prompt",
        )


def _jobs(engine: Engine, prompts, ask, envelope, on_event) -> list:
    """n jobs per prompt, choice p * n + i drawing with seed + i."""
    jobs = []
    seed = random.getrandbits(32) if ask.seed is None else ask.seed
    limit = engine.slots.max_seq_len
    for p, prompt in enumerate(prompts):
        for i in range(ask.n):
            sampling = Sampling(ask.temperature, ask.top_k, ask.top_p, (seed + i) % 2**32)
            # No max_tokens (chat): as much as the context leaves (at least one token, so a
            # prompt that fills the context is refused as too long).
            max_tokens = ask.max_tokens
            if max_tokens is None:
                max_tokens = max(limit - len(prompt), 1)
            try:
                job = engine.job(
                    prompt,
                    max_tokens=max_tokens,
                    sampling=sampling,
                    stop=ask.stop,
                    ignore_eos=ask.ignore_eos,
                    logprobs=ask.logprobs,
                    echo=ask.echo,
                    on_event=functools.partial(on_event, p * ask.n + i),
                )
            except ValueError as e:
                raise ApiError(str(e), param="messages" if envelope.chat else "prompt") from None
            jobs.append(job)
    return jobs


async def _serve(engine: Engine, request: Request, body, envelope, prompts, jobs, finish, events):
    """`finish(texts) -> (texts, logprobs)`: the choices' final texts and log-probabilities."""
    try:
        engine.submit(jobs)
    except QueueFullError as e:
        raise ApiError(str(e), status=503, kind="overloaded_error") from None
    except EngineStoppedError as e:
        raise ApiError(str(e), status=500) from None
    prompt_tokens = sum(len(p) for p in prompts)
    watcher = asyncio.ensure_future(_on_disconnect(request, engine, jobs, events))
    _bridge(request).watch(engine, events, watcher)
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
    # (Tokens' texts are decoded here: off the event loop.)
    texts, choice_logprobs = await asyncio.to_thread(finish, texts)
    usage = protocol.usage(prompt_tokens, completion_tokens)
    return envelope.response(texts, reasons, usage, choice_logprobs)


class _Bridge:
    """Events from the engine thread into the event loop's queues, one wake-up of the loop
    for all the events of an engine step (not one per token per request).

    And a watchdog: the engine fails every request it holds when its thread ends, but should
    it end without a word to some request, that request gets an error event within
    `_ENGINE_CHECK_SECONDS` (one task looks at the engine while any request waits on it)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.lock = threading.Lock()
        self.pending: list = []
        self.waiting: dict[asyncio.Queue, asyncio.Future] = {}  # a request's events: its watcher
        self.watchdog: asyncio.Future | None = None

    def watch(self, engine: Engine, events: asyncio.Queue, watcher: asyncio.Future) -> None:
        """Until `watcher` (the request's disconnect watcher, cancelled when it ends) is done."""
        self.waiting[events] = watcher
        if self.watchdog is None or self.watchdog.done():
            self.watchdog = asyncio.ensure_future(self._watch(engine))

    async def _watch(self, engine: Engine) -> None:
        while self.waiting:
            await asyncio.sleep(_ENGINE_CHECK_SECONDS)
            stopped = engine.stopped()
            for events, watcher in list(self.waiting.items()):
                if watcher.done():
                    del self.waiting[events]
                elif stopped is not None:
                    del self.waiting[events]
                    events.put_nowait((0, Event("", "error", 0, error=stopped)))

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
