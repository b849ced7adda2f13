"""The OpenAI HTTP API's request bodies (pydantic models) and the checks and shapes around
them: reading a body (`parse`), what a request asks for (`Ask`), the 400 errors, the
responses and stream chunks.

A completion's `prompt` is checked here (`prompts`) rather than by a pydantic union: pydantic
tries each member of `str | list[str] | list[int] | list[list[int]]` over the whole list, an
order of magnitude slower for a long list of token ids than one pass of type checks, and
holding the interpreter (so the engine thread too) all along (docs/serving.md, "Limits").

Log probabilities: completions take OpenAI's legacy `logprobs: k` (an integer, 0 to
`MAX_LOGPROBS`) and `echo` (the prompt scored and prepended; with `max_tokens: 0` nothing is
generated); chat takes `logprobs: true` and `top_logprobs: k`. Neither is streamed yet: with
`stream` they are a 400. Fields OpenAI defines that this server does not implement
(penalties, logit bias, suffix, best_of) are refused with a 400 when set to anything but
their no-op value, rather than silently ignored: a client relying on them would get wrong
results. Fields no one defines are ignored, as OpenAI ignores them. Beyond OpenAI, `top_k`
and `ignore_eos` (vLLM's names; with the `openai` client: `extra_body={...}`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
import uuid

from pydantic import BaseModel, ConfigDict, ValidationError

from nnx_zoo.serving.slots import MAX_LOGPROBS
from nnx_zoo.serving.text import MAX_STOP_CHARS, MAX_STOP_STRINGS

# OpenAI's defaults: a completion is 16 tokens unless asked; sampling at temperature 1.
COMPLETION_MAX_TOKENS = 16
DEFAULT_TEMPERATURE = 1.0


class ApiError(Exception):
    """An OpenAI-shaped error: status, message, the offending parameter, a code."""

    def __init__(self, message: str, *, status: int = 400, param=None, code=None, kind=None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return error_body(str(self), kind=self.kind, param=self.param, code=self.code)


def error_body(message: str, *, kind="invalid_request_error", param=None, code=None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Sampled(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    # Completions: the number of alternatives (an integer); chat: whether (a boolean).
    logprobs: int | bool | None = None
    # Defined by OpenAI, not implemented here: refused unless at their no-op value.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict | None = None


class CompletionRequest(_Sampled):
    prompt: str | list  # a string, token ids, or a list of either: `prompts` checks which
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, ...: the template's business
    role: str
    content: str | list[ContentPart] | None = None


class ChatRequest(_Sampled):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # the newer name of max_tokens
    top_logprobs: int | None = None


@dataclasses.dataclass(frozen=True)
class Ask:
    """A request's generation settings, checked."""

    max_tokens: int | None  # None: the rest of the context
    temperature: float
    top_p: float
    top_k: int  # 0: every token
    seed: int | None
    stop: tuple[str, ...]
    n: int
    ignore_eos: bool
    logprobs: int | None = None  # None: none; k: each token's and its k likeliest alternatives'
    echo: bool = False  # completions: the prompt scored and prepended


def parse(raw: bytes, model: type[BaseModel]) -> BaseModel:
    """A request body read into `model`, or ApiError(400) saying what is wrong with it."""
    try:
        fields = json.loads(raw)
    except (ValueError, RecursionError) as e:  # (JSONDecodeError and UnicodeDecodeError)
        raise ApiError(f"the request body is not valid JSON ({e})") from None
    try:
        return model.model_validate(fields)
    except ValidationError as e:
        raise _validation_error(e) from None


def _validation_error(error: ValidationError) -> ApiError:
    """One message for pydantic's list of errors: the first, naming its field."""
    first = error.errors()[0] if error.errors() else {}
    where = ".".join(str(part) for part in first.get("loc", ()))
    if first.get("type") == "missing":
        return ApiError(f"missing required field {where!r}", param=where or None)
    return ApiError(f"{where or 'body'}: {first.get('msg', 'invalid')}", param=where or None)


def prompts(prompt: str | list) -> list[str | list[int]]:
    """A completion's prompts, each a string or token ids (a string, token ids, or a list of
    either), or ApiError(400)."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(type(t) is int for t in prompt):
        return [prompt]
    for p in prompt:
        if not (isinstance(p, str) or (isinstance(p, list) and all(type(t) is int for t in p))):
            raise ApiError(
                "prompt must be a string, a list of token ids, or a list of strings or of "
                f"token id lists; found an element {type(p).__name__}",
                param="prompt",
            )
    return list(prompt)


def check(request: _Sampled, *, served_model: str, capacity: int) -> Ask:
    """The request's settings, or ApiError(400) naming the first bad one. `capacity`: the
    most sequences the server holds at once (running and waiting)."""
    if request.model != served_model:
        raise ApiError(
            f"the model {request.model!r} does not exist; this server serves {served_model!r}",
            param="model",
            code="model_not_found",
        )
    _refuse_unimplemented(request)
    logprobs, echo = _logprobs(request)
    max_tokens = request.max_tokens
    if isinstance(request, ChatRequest) and request.max_completion_tokens is not None:
        max_tokens = request.max_completion_tokens
    elif isinstance(request, CompletionRequest) and max_tokens is None:
        max_tokens = COMPLETION_MAX_TOKENS
    if max_tokens is not None and max_tokens < 1 and not (echo and max_tokens == 0):
        raise ApiError(
            f"max_tokens={max_tokens} must be >= 1 (0 only with echo: the prompt scored)",
            param="max_tokens",
        )
    temperature = DEFAULT_TEMPERATURE if request.temperature is None else request.temperature
    if not math.isfinite(temperature) or temperature < 0:
        raise ApiError(
            f"temperature={temperature} must be a finite number >= 0 (0: greedy)",
            param="temperature",
        )
    top_p = 1.0 if request.top_p is None else request.top_p
    if not 0.0 < top_p <= 1.0:  # also refuses nan
        raise ApiError(f"top_p={top_p} must be in (0, 1]", param="top_p")
    top_k = request.top_k or 0
    if top_k < -1:
        raise ApiError(f"top_k={top_k} must be >= 1, or 0 / -1 for every token", param="top_k")
    if not 1 <= request.n <= capacity:
        raise ApiError(
            f"n={request.n} must be in [1, {capacity}] (the most sequences this server holds "
            "at once: --max_batch + --max_queue)",
            param="n",
        )
    stop = (request.stop,) if isinstance(request.stop, str) else tuple(request.stop or ())
    if len(stop) > MAX_STOP_STRINGS:
        raise ApiError(
            f"stop holds {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed",
            param="stop",
        )
    if (longest := max(map(len, stop), default=0)) > MAX_STOP_CHARS:
        raise ApiError(
            f"a stop string of {longest} characters; at most {MAX_STOP_CHARS} are allowed",
            param="stop",
        )
    return Ask(
        max_tokens=max_tokens,
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=max(top_k, 0),
        seed=request.seed,
        stop=tuple(s for s in stop if s),
        n=request.n,
        ignore_eos=request.ignore_eos,
        logprobs=logprobs,
        echo=echo,
    )


def _logprobs(request: _Sampled) -> tuple[int | None, bool]:
    """(alternatives per token, or None for no log-probabilities; echo), checked."""
    value = request.logprobs
    if isinstance(request, ChatRequest):
        if value is not None and type(value) is not bool:
            raise ApiError("logprobs must be true or false on chat completions", param="logprobs")
        top = request.top_logprobs
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise ApiError(
                f"top_logprobs={top} must be in [0, {MAX_LOGPROBS}]", param="top_logprobs"
            )
        if top and not value:
            raise ApiError("top_logprobs needs logprobs: true", param="top_logprobs")
        k, echo = (top or 0) if value else None, False
    else:
        if type(value) is bool:
            raise ApiError(
                f"logprobs must be an integer in [0, {MAX_LOGPROBS}] on completions (the "
                "number of alternatives per token), not a boolean",
                param="logprobs",
            )
        if value is not None and not 0 <= value <= MAX_LOGPROBS:
            raise ApiError(f"logprobs={value} must be in [0, {MAX_LOGPROBS}]", param="logprobs")
        k, echo = value, bool(request.echo)
    if request.stream and (k is not None or echo):
        what = "echo" if echo else "logprobs"
        raise ApiError(f"{what} is not supported with stream by this server", param=what)
    return k, echo


def _refuse_unimplemented(request: _Sampled) -> None:
    no_op = {
        "presence_penalty": (None, 0, 0.0),
        "frequency_penalty": (None, 0, 0.0),
        "logit_bias": (None, {}),
        "suffix": (None, ""),
    }
    for name, allowed in no_op.items():
        value = getattr(request, name, None)
        if value not in allowed:
            raise ApiError(f"{name} is not supported by this server", param=name)
    best_of = getattr(request, "best_of", None)
    if best_of is not None and best_of != request.n:
        raise ApiError("best_of other than n is not supported by this server", param="best_of")


def chat_text(message: ChatMessage) -> ChatMessage | dict:
    """The message as the chat template takes it: text parts joined into one string."""
    fields = message.model_dump(exclude_none=True)
    if isinstance(message.content, list):
        kinds = {part.type for part in message.content}
        if kinds - {"text"}:
            raise ApiError(
                f"message content parts of type {sorted(kinds - {'text'})} are not supported "
                "(text only)",
                param="messages",
            )
        fields["content"] = "".join(part.text or "" for part in message.content)
    return fields


# -- responses ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Envelope:
    """What every response and chunk of one request repeats."""

    model: str
    chat: bool
    id: str = ""
    created: int = 0

    def __post_init__(self):
        self.id = self.id or f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = self.created or int(time.time())

    def head(self, chunk: bool) -> dict:
        kind = ("chat.completion" if self.chat else "text_completion") + (
            ".chunk" if chunk and self.chat else ""
        )
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def response(self, texts, reasons, usage, logprobs=None) -> dict:
        """`logprobs`: each choice's log-probabilities object (`serving.logprobs`), or None."""
        choices = []
        logprobs = logprobs or [None] * len(texts)
        for index, (text, reason, lp) in enumerate(zip(texts, reasons, logprobs, strict=True)):
            if self.chat:
                message = {"role": "assistant", "content": text}
                choices.append(
                    dict(index=index, message=message, logprobs=lp, finish_reason=reason)
                )
            else:
                choices.append(dict(index=index, text=text, logprobs=lp, finish_reason=reason))
        return {**self.head(False), "choices": choices, "usage": usage}

    def chunk(self, index: int, text: str | None, reason: str | None, *, role=False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else {}
            if text:
                delta["content"] = text
            choice = dict(index=index, delta=delta, logprobs=None, finish_reason=reason)
        else:
            choice = dict(index=index, text=text or "", logprobs=None, finish_reason=reason)
        return {**self.head(True), "choices": [choice]}

    def usage_chunk(self, usage) -> dict:
        return {**self.head(True), "choices": [], "usage": usage}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
