"""From a request's generated token ids to the text a client sees: incremental decoding, stop
strings, EOS and the token budget (one `TextStream` per sequence).

Text goes out in pieces as tokens arrive, but not every piece may go out at once:
  - a token can end in the middle of a UTF-8 character (byte tokenizers, byte-fallback
    BPE), which decodes to U+FFFD until the rest arrives: held back until then;
  - the end of the text may be the start of a stop string ("\\n\\nUs" before "\\n\\nUser:"):
    held back until it is clear it is not one. A stop string that completes cuts the text
    where it starts, and is not sent (OpenAI's rule).
So the concatenated deltas always equal the final text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

REPLACEMENT = "\ufffd"


class Delta(NamedTuple):
    text: str  # new text since the last delta ("" allowed)
    finish_reason: str | None  # None: more to come; "stop" (EOS or a stop string) or "length"


class TextStream:
    def __init__(
        self,
        tokenizer,
        *,
        max_tokens: int,
        stop: Sequence[str] = (),
        eos_id: int | None = None,
    ):
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        self.stop = [s for s in stop if s]
        self.eos_id = eos_id
        self.ids: list[int] = []  # the tokens sampled, EOS included
        self.text = ""  # what was sent so far
        self.finish_reason: str | None = None

    @property
    def num_tokens(self) -> int:
        """Generated tokens (usage's completion_tokens): every token sampled, EOS included."""
        return len(self.ids)

    def add(self, token: int) -> Delta:
        if self.finish_reason is not None:
            raise RuntimeError("add() after the sequence finished")
        self.ids.append(int(token))
        if token == self.eos_id:
            return self._finish(self._decoded(), "stop")
        full = self._decoded()
        # Held back while it could begin a stop string, a stop starts in the unsent text.
        found = [at for at in (full.find(s, len(self.text)) for s in self.stop) if at >= 0]
        if found:
            return self._finish(full[: min(found)], "stop")
        if len(self.ids) >= self.max_tokens:
            return self._finish(full, "length")
        ready = full.removesuffix(REPLACEMENT) if full.endswith(REPLACEMENT) else full
        ready = ready[: len(ready) - _stop_prefix_len(ready, self.stop)]
        if len(ready) <= len(self.text):
            return Delta("", None)
        delta, self.text = ready[len(self.text) :], ready
        return Delta(delta, None)

    def _decoded(self) -> str:
        # Whole sequence each time: a tokenizer's decode of a piece is not the piece of the
        # decode (leading spaces of SentencePiece words, multi-token characters).
        ids = self.ids[:-1] if self.ids and self.ids[-1] == self.eos_id else self.ids
        return self.tokenizer.decode(ids)

    def _finish(self, final: str, reason: str) -> Delta:
        self.finish_reason = reason
        # Withheld text is sent now; text already sent is never taken back.
        delta = final[len(self.text) :] if final.startswith(self.text) else ""
        self.text += delta
        return Delta(delta, reason)


def _stop_prefix_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest end of `text` that is the start of some stop string."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest
