"""The harness's strings as token ids, by the conventions of lm-eval's Hugging Face backend.

lm-eval hands a backend strings; the ids it scores depend on the backend's BOS/EOS rules, so
ours follow its `hf` backend (lm_eval/models/huggingface.py, 0.4.13) for the same tokenizer:

  - `encode(s)` adds the tokenizer's own special tokens (a `tokenizer.json`'s post-processor:
    Llama's adds BOS, GPT-2's and Qwen's add nothing), unless `s` already starts with the
    text of the prefix token; `encode(s, specials=False)` adds none.
  - The prefix token (what an empty context and the first rolling window condition on) is
    BOS when the tokenizer names one (`bos_token` in `tokenizer_config.json`), else EOS.
  - A (context, continuation) pair moves the context's trailing spaces onto the
    continuation, encodes context + continuation whole and splits it after the context's
    own ids (so a BOS, when the tokenizer adds one, is in the context).
  - An empty context is the prefix token alone, unless the continuation's first id already
    is that token.
  - Decoded generations skip special tokens.

The project's byte tokenizer has no BOS: its prefix is EOS (id 256). A SentencePiece `.model`
adds its BOS when it has one (as transformers' Llama tokenizers do by default).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from nnx_zoo.data.tokenizers import ByteTokenizer, HfTokenizer, SentencePieceTokenizer, Tokenizer
from nnx_zoo.errors import UsageError


def _config_token(path: str, key: str) -> str | None:
    """A special token's text in a `tokenizer_config.json` (a string or {"content": ...})."""
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        value = json.load(f).get(key)
    return value.get("content") if isinstance(value, dict) else value


class HarnessTokens:
    """Encode / decode for the harness over one of the project's tokenizers."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.eos_id = tokenizer.eos_id
        self.bos_id: int | None = None
        self._hf = None
        self._sp = None
        if isinstance(tokenizer, HfTokenizer):
            from tokenizers import Tokenizer as _HfTok

            self._hf = _HfTok.from_file(tokenizer.path)
            config = os.path.join(os.path.dirname(tokenizer.path), "tokenizer_config.json")
            bos = _config_token(config, "bos_token")
            self.bos_id = None if bos is None else self._hf.token_to_id(bos)
        elif isinstance(tokenizer, SentencePieceTokenizer):
            self._sp = tokenizer._sp
            bos = self._sp.bos_id()
            self.bos_id = bos if bos >= 0 else None
        elif not isinstance(tokenizer, ByteTokenizer):
            raise UsageError(f"no harness conventions for tokenizer {tokenizer!r}")
        self.prefix_id = self.eos_id if self.bos_id is None else self.bos_id
        self.prefix_text = self._token_text(self.prefix_id)

    def _token_text(self, token_id: int) -> str | None:
        if self._hf is not None:
            return self._hf.id_to_token(token_id)
        if self._sp is not None and token_id < self._sp.get_piece_size():
            return self._sp.id_to_piece(token_id)
        return None  # the byte tokenizer's EOS has no text

    def encode(self, text: str, specials: bool | None = None) -> list[int]:
        """Ids of `text`; `specials` None: the tokenizer's own special tokens unless the text
        already starts with the prefix token's text (the hf backend's `tok_encode`)."""
        if specials is None:
            specials = not (self.prefix_text and text.startswith(self.prefix_text))
        if self._hf is not None:
            return self._hf.encode(text, add_special_tokens=specials).ids
        ids = self.tokenizer.encode(text)
        if specials and self._sp is not None and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    def encode_batch_start(self, texts: Sequence[str]) -> list[list[int]]:
        """Contexts for generation (the hf backend's `tok_batch_encode`): special tokens off
        for the whole batch when the first text starts with BOS's text, else the default."""
        bos_text = None if self.bos_id is None else self._token_text(self.bos_id)
        specials = not (bos_text and texts[0].startswith(bos_text))
        return [self.encode(t, specials=specials) for t in texts]

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(context ids, continuation ids) of one loglikelihood request."""
        if context == "":
            cont = self.encode(continuation, specials=False)
            if cont and cont[0] == self.prefix_id:
                return cont[:1], cont[1:]
            return [self.prefix_id], cont
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            continuation = context[-n_spaces:] + continuation
            context = context[:-n_spaces]
        whole = self.encode(context + continuation)
        ctx = self.encode(context)
        return ctx, whole[len(ctx) :]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of generated ids, special tokens skipped."""
        if self._hf is not None:
            return self._hf.decode([int(i) for i in ids], skip_special_tokens=True)
        return self.tokenizer.decode(ids)


def rolling_windows(
    ids: Sequence[int], prefix_id: int, max_length: int
) -> list[tuple[list[int], list[int]]]:
    """(context, scored) windows of a whole document for `loglikelihood_rolling`: every id
    scored once, each window at most `max_length` inputs with as much context as fits, the
    first conditioned on the prefix token (lm_eval.utils' rolling and disjoint windows)."""
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    return [
        make_disjoint_window(w)
        for w in get_rolling_token_windows(
            token_list=list(ids), prefix_token=prefix_id, max_seq_len=max_length, context_len=1
        )
    ]
