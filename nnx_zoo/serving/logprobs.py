"""Log probabilities in OpenAI's two shapes, from what the engine recorded per token
(`scheduler.TokenLogprob`: the token, its log-probability, its k most likely alternatives).

Completions (the legacy shape), one object per choice:
    {"tokens": [text, ...], "token_logprobs": [lp, ...], "text_offset": [int, ...],
     "top_logprobs": [{text: lp, ...}, ...]}
With `echo` the prompt's tokens come first; the first has no log-probability (null, and null
top_logprobs), as OpenAI's. Each `top_logprobs` dict holds the k most likely tokens and the
token itself (OpenAI: "up to logprobs + 1 elements"), keyed by text. A key must name one token,
so a token without a text of its own -- a byte of an unfinished UTF-8 character (which decodes
to U+FFFD, as 128 byte tokens of a byte-level BPE do), an id the tokenizer has no text for (a
model's padded vocabulary), or one whose text an earlier key took -- is keyed `token_id:N`
(vLLM's spelling). `text_offset` is each token's start in the choice's
`text` (the prompt included with echo).

Chat completions (the newer shape): `{"content": [{"token", "logprob", "bytes",
"top_logprobs": [{"token", "logprob", "bytes"}, ...k]}, ...], "refusal": null}`.

A token's text is its text in context (the decode of a window of tokens ending at it, less
the decode of the window before it: SentencePiece's leading spaces come out right); an
alternative's is its decode alone. A token that ends inside a UTF-8 character has the
replacement character, or nothing, as its text; `bytes` are its text's UTF-8 bytes.

Which tokens are listed: those the returned text covers. A choice cut by a stop string lists
the tokens that start before the cut; a completion that ended at EOS lists the EOS token last
(its text empty): lm-eval's `local-completions` drops the last entry of a 1-token echo as the
generated one, whatever it is. A chat choice's content never lists EOS.
"""

from __future__ import annotations

from collections.abc import Sequence

from nnx_zoo.serving.scheduler import Job, TokenLogprob
from nnx_zoo.serving.text import REPLACEMENT

# Tokens of context before each token when finding its text (a character spans at most 4).
_WINDOW = 8


def token_texts(tokenizer, ids: Sequence[int]) -> list[str]:
    """Each token's text in context."""
    out = []
    for i in range(len(ids)):
        start = max(0, i - _WINDOW)
        before = tokenizer.decode(ids[start:i]) if i > start else ""
        out.append(tokenizer.decode(ids[start : i + 1])[len(before) :])
    return out


class _Alone:
    """Tokens' texts decoded alone, each once per response."""

    def __init__(self, tokenizer):
        self.tokenizer, self.seen = tokenizer, {}

    def __call__(self, token: int) -> str:
        if token not in self.seen:
            self.seen[token] = self.tokenizer.decode([token])
        return self.seen[token]


def top_key(text: str, token: int) -> str:
    """A `top_logprobs` key: the token's text, or `token_id:N` when it has none of its own."""
    return text if text and REPLACEMENT not in text else f"token_id:{token}"


def _top_dict(entry: TokenLogprob, alone: _Alone) -> dict[str, float]:
    top: dict[str, float] = {}
    owner: dict[str, int] = {}
    for token, logprob in (*entry.top, (entry.token, entry.logprob)):
        key = top_key(alone(token), token)
        if owner.setdefault(key, token) != token:
            key = f"token_id:{token}"
        top.setdefault(key, logprob)
    return top


def listed(job: Job, text: str) -> list[TokenLogprob]:
    """The generated tokens `text` (the choice's generated text) covers."""
    entries, stream = job.token_logprobs, job.stream
    ended_at_eos = bool(stream.ids) and stream.ids[-1] == stream.eos_id
    if stream.finish_reason != "stop" or ended_at_eos:
        return list(entries)
    # Cut by a stop string: the tokens that start before the cut.
    texts = token_texts(stream.tokenizer, [e.token for e in entries])
    kept, at = [], 0
    for entry, piece in zip(entries, texts, strict=True):
        if at >= len(text):
            break
        kept.append(entry)
        at += len(piece)
    return kept


def completion(job: Job, text: str, prompt_text: str | None) -> dict:
    """The legacy `logprobs` object of one choice: `text` its generated text, `prompt_text`
    the prompt as echoed (None: no echo)."""
    tokenizer = job.stream.tokenizer
    alone = _Alone(tokenizer)
    generated = listed(job, text)
    prompt = job.prompt_logprobs if prompt_text is not None else []
    entries = [*prompt, *generated]
    texts = token_texts(tokenizer, [e.token for e in entries])
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    at = 0
    if prompt_text is not None:
        # The prompt's own text may differ from its tokens' decode (a string prompt is echoed
        # as sent): the generated tokens' offsets start where the echoed prompt ends.
        prompt_end = len(prompt_text)
    for i, (entry, piece) in enumerate(zip(entries, texts, strict=True)):
        if prompt_text is not None and i == len(prompt):
            at = prompt_end
        out["tokens"].append(piece)
        out["token_logprobs"].append(entry.logprob)
        out["text_offset"].append(at)
        at += len(piece)
        if entry.logprob is None:
            out["top_logprobs"].append(None)
            continue
        out["top_logprobs"].append(_top_dict(entry, alone))
    return out


def chat(job: Job, text: str) -> dict:
    """The chat `logprobs` object of one choice (`text`: its content)."""
    tokenizer = job.stream.tokenizer
    alone = _Alone(tokenizer)
    entries = [e for e in listed(job, text) if e.token != job.stream.eos_id]
    texts = token_texts(tokenizer, [e.token for e in entries])
    content = []
    for entry, piece in zip(entries, texts, strict=True):
        top = [_chat_token(alone(token), logprob) for token, logprob in entry.top]
        content.append({**_chat_token(piece, entry.logprob), "top_logprobs": top})
    return {"content": content, "refusal": None}


def _chat_token(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
