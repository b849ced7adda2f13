"""From a request's generated token ids to the text a client sees: incremental decoding, stop
strings, EOS and the token budget (one `TextStream` per sequence).

Text goes out in pieces as tokens arrive, but not every piece may go out at once:
  - a token can end in the middle of a UTF-8 character (byte tokenizers, byte-fallback
    BPE), which decodes to U+FFFD until the rest arrives: held back until then;
  - the end of the text may be the start of a stop string ("\\n\\nUs" before "\\n\\nUser:"):
    held back until it is clear it is not one. A stop string that completes cuts the text
    where it starts, and is not sent (OpenAI's rule).
So the concatenated deltas always equal the final text.

The work per token is bounded, whatever the length of the text so far: this runs on the
engine thread, between every decode step of every request. Decoding is incremental (a window
of the last few tokens, as vLLM and transformers' streamers do: a tokenizer's decode of a
piece is not the piece of the decode -- SentencePiece's leading spaces, characters of several
tokens -- but the decode of `prefix + new` minus the decode of `prefix` is), and stop strings
are looked for only in the text not sent yet, which is the newly decoded text plus at most the
longest stop string less one character held back. The number and length of stop strings are
bounded by the server (`MAX_STOP_STRINGS`, `MAX_STOP_CHARS`; `protocol.check`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

REPLACEMENT = "\ufffd"
# A character takes at most 4 tokens (4 UTF-8 bytes: byte tokenizers, byte-fallback BPE). A
# window of more tokens still ending in U+FFFD ends in invalid bytes, not in an incomplete
# character: its text goes out, so a model that writes invalid bytes forever does not grow the
# window (and each token's decode) without end.
_MAX_PENDING_TOKENS = 8

# What one request may ask for: OpenAI takes 4 stop strings; 16 covers the role markers and
# end tags of every chat format and lm-eval's `until` lists with room to spare. 256 characters
# is longer than any such marker, and bounds what is held back from a stream (the longest stop
# string less one character) and the matching work per token (count x length).
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256


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
        self.finish_reason: str | None = None
        self._sent: list[str] = []  # the deltas sent so far
        self._held = ""  # decoded, not sent: it could be the start of a stop string
        # The decode window: ids[_prefix_at:] is decoded each token; ids[_prefix_at:_read_at]
        # (whose text, `_prefix_text`, went out already) gives the new text its context.
        self._prefix_at = self._read_at = 0
        self._prefix_text = ""

    @property
    def num_tokens(self) -> int:
        """Generated tokens (usage's completion_tokens): every token sampled, EOS included."""
        return len(self.ids)

    @property
    def text(self) -> str:
        """What was sent so far."""
        return "".join(self._sent)

    def add(self, token: int) -> Delta:
        if self.finish_reason is not None:
            raise RuntimeError("add() after the sequence finished")
        self.ids.append(int(token))
        if token == self.eos_id:  # no text of its own: what is held back goes out
            return self._finish(self._held + self._new_text(len(self.ids) - 1, True), "stop")
        last = len(self.ids) >= self.max_tokens
        unsent = self._held + self._new_text(len(self.ids), last)
        found = [at for at in (unsent.find(s) for s in self.stop) if at >= 0]
        if found:
            return self._finish(unsent[: min(found)], "stop")
        if last:
            return self._finish(unsent, "length")
        keep = len(unsent) - _stop_prefix_len(unsent, self.stop)
        delta, self._held = unsent[:keep], unsent[keep:]
        if delta:
            self._sent.append(delta)
        return Delta(delta, None)

    def close(self, reason: str) -> Delta:
        """Finish without another token (a request that asked for none)."""
        if self.finish_reason is not None:
            raise RuntimeError("close() after the sequence finished")
        return self._finish("", reason)

    def _new_text(self, end: int, final: bool) -> str:
        """The text ids[:end] adds to what was decoded before; "" while it ends in the middle
        of a character (unless `final`: then as it is)."""
        window = self.tokenizer.decode(self.ids[self._prefix_at : end])
        pending = end - self._read_at
        if window.endswith(REPLACEMENT) and not final and pending < _MAX_PENDING_TOKENS:
            return ""
        new = window[len(self._prefix_text) :]
        self._prefix_at, self._read_at = self._read_at, end
        self._prefix_text = self.tokenizer.decode(self.ids[self._prefix_at : end])
        return new

    def _finish(self, final: str, reason: str) -> Delta:
        self.finish_reason = reason
        self._held = ""
        if final:
            self._sent.append(final)
        return Delta(final, reason)


def _stop_prefix_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest end of `text` that is the start of some stop string (shorter
    than it: a whole one was found already). Looks at the last len(stop) - 1 characters only,
    and there only where the stop's first character is."""
    longest = 0
    for stop in stops:
        at = text.find(stop[0], max(len(text) - len(stop) + 1, 0))
        while at >= 0 and len(text) - at > longest:
            if stop.startswith(text[at:]):
                longest = len(text) - at
                break
            at = text.find(stop[0], at + 1)
    return longest
