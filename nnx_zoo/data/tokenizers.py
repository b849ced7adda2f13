"""Tokenizers behind one small interface: byte-level, Hugging Face `tokenizer.json`, SentencePiece.

Every tokenizer has `encode(text) -> list[int]`, `decode(ids) -> str`, `vocab_size`, `eos_id`
(the id the data pipeline appends to each document) and `token_num_bytes`, an int array [V] with
the number of UTF-8 bytes each id stands for (0 for EOS and special tokens). `num_bytes(ids)` sums
it, so evaluation can report bits per byte = total_nll_nats / ln(2) / total_bytes over the
predicted tokens without decoding.

`make_tokenizer(spec)` picks one: 'byte', a path to a `tokenizer.json` (or a directory holding
one), or a path to a SentencePiece `.model`.
"""

from __future__ import annotations

import abc
import json
import os
import re
from collections.abc import Sequence

import numpy as np

from nnx_zoo.errors import UsageError
from nnx_zoo.runtime.console import one_line

# Names of end-of-document tokens in common Hugging Face vocabularies, most specific first.
_HF_EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]")
_BYTE_FALLBACK_PIECE = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")


class Tokenizer(abc.ABC):
    """The interface the data pipeline, evaluation and generation rely on."""

    eos_id: int
    vocab_size: int  # every id in [0, vocab_size) may appear; models need at least this many rows
    token_num_bytes: np.ndarray  # int64 [vocab_size]: UTF-8 bytes each id decodes to

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]:
        """Ids of `text`, with no EOS/BOS added (the pipeline appends `eos_id` itself)."""

    @abc.abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`; EOS and ids outside the vocabulary are dropped."""

    def encode_with_starts(self, text: str) -> tuple[list[int], np.ndarray]:
        """(ids of `text` as `encode` gives them, the index in `text` of each id's first
        character): what a per-token loss mask over character spans needs."""
        raise UsageError(
            f"{self!r} gives no character offsets; chat data needs a tokenizer.json or 'byte'"
        )

    def num_bytes(self, ids) -> int:
        """UTF-8 bytes that `ids` stand for (the denominator of bits per byte)."""
        return int(self.token_num_bytes[np.asarray(ids, dtype=np.int64)].sum())


class ByteTokenizer(Tokenizer):
    """Ids 0..255 are the UTF-8 bytes of the text; id 256 is EOS. vocab_size = 257."""

    eos_id = 256
    vocab_size = 257

    def __init__(self):
        self.token_num_bytes = np.array([1] * 256 + [0], dtype=np.int64)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_np(self, text: str) -> np.ndarray:
        """Fast path for the data pipeline: the bytes as an int32 array."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def encode_with_starts(self, text: str) -> tuple[list[int], np.ndarray]:
        starts = [i for i, ch in enumerate(text) for _ in range(len(ch.encode("utf-8")))]
        return self.encode(text), np.asarray(starts, np.int64)

    def decode(self, ids: Sequence[int]) -> str:
        # errors='replace' because generation can stop in the middle of a multi-byte character.
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"

    def save_pretrained(self, directory: str) -> None:
        """This tokenizer as Hugging Face files in `directory`: a `tokenizer.json` (byte-level
        BPE without merges, so each UTF-8 byte is its own id, EOS `BYTE_EOS_TOKEN` = 256) and a
        `tokenizer_config.json`, which transformers' AutoTokenizer loads and which encode and
        decode exactly as this class does."""
        from tokenizers import Tokenizer as _HfTok
        from tokenizers import decoders, models, pre_tokenizers

        tok = _HfTok(models.BPE(vocab=_gpt2_unicode_to_byte(), merges=[]))
        # No regex split: the text's bytes go whole to the (merge-free) model, one id each.
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([BYTE_EOS_TOKEN])
        assert tok.token_to_id(BYTE_EOS_TOKEN) == self.eos_id
        os.makedirs(directory, exist_ok=True)
        tok.save(os.path.join(directory, "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": BYTE_EOS_TOKEN,
            "model_max_length": 1 << 30,
            "clean_up_tokenization_spaces": False,
        }
        with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)
            f.write("\n")


# The name of the byte tokenizer's EOS (id 256) in its Hugging Face files.
BYTE_EOS_TOKEN = "<|endoftext|>"


def _gpt2_unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: the printable character standing for each byte."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = list(printable)
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _has_type(node, type_name: str) -> bool:
    """Whether a tokenizer.json component (possibly a Sequence of them) has `type_name`."""
    if isinstance(node, dict):
        if node.get("type") == type_name:
            return True
        return any(_has_type(v, type_name) for v in node.values())
    if isinstance(node, list):
        return any(_has_type(v, type_name) for v in node)
    return False


class HfTokenizer(Tokenizer):
    """A local Hugging Face `tokenizer.json`, through the `tokenizers` library.

    EOS is the `eos_token` of a `tokenizer_config.json` beside the file, else the first of
    `_HF_EOS_CANDIDATES` in the vocabulary, else one extra id past the vocabulary (then
    vocab_size is one larger than the file's). Byte counts are exact for byte-level BPE (GPT-2,
    Llama 3, Qwen) and SentencePiece-style vocabularies ('▁' = space, '<0xAB>' = one byte); for
    WordPiece they ignore the spaces the decoder inserts.
    """

    def __init__(self, path: str):
        from tokenizers import Tokenizer as _HfTok

        self.path = path
        try:
            self._tok = _HfTok.from_file(path)
        except Exception as e:  # noqa: BLE001 -- the library raises bare Exceptions
            raise UsageError(
                f"{path}: not a tokenizer.json the tokenizers library can read ({one_line(e)})"
            ) from None
        spec = json.loads(self._tok.to_str())
        base_size = self._tok.get_vocab_size(with_added_tokens=True)
        vocab = self._tok.get_vocab(with_added_tokens=True)
        eos_token = _eos_from_config(os.path.join(os.path.dirname(path), "tokenizer_config.json"))
        candidates = ([eos_token] if eos_token else []) + list(_HF_EOS_CANDIDATES)
        eos = next((vocab[t] for t in candidates if t in vocab), None)
        self.eos_id = base_size if eos is None else eos
        self.vocab_size = base_size + (eos is None)

        special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
        byte_level = _has_type(spec.get("decoder"), "ByteLevel")
        to_byte = _gpt2_unicode_to_byte()
        num_bytes = np.zeros(self.vocab_size, dtype=np.int64)
        for token, i in vocab.items():
            if i in special or i == self.eos_id:
                continue
            if byte_level:
                num_bytes[i] = (
                    len(token) if all(c in to_byte for c in token) else len(token.encode())
                )
            elif _BYTE_FALLBACK_PIECE.match(token):
                num_bytes[i] = 1
            else:
                num_bytes[i] = len(token.removeprefix("##").replace("▁", " ").encode())
        self.token_num_bytes = num_bytes

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_concurrently(self, text: str) -> list[int]:
        """`encode`, letting other threads run meanwhile: the tokenizers library lets go of
        the interpreter in its batch call only (`encode` holds it throughout, so a long text
        stops every other thread). A call costs a little more than `encode`'s: for a server's
        prompts (nnx_zoo/serving), not a data pipeline's documents."""
        return self._tok.encode_batch([text], add_special_tokens=False)[0].ids

    def encode_with_starts(self, text: str) -> tuple[list[int], np.ndarray]:
        encoding = self._tok.encode(text, add_special_tokens=False)
        return encoding.ids, np.asarray([start for start, _ in encoding.offsets], np.int64)

    def decode(self, ids: Sequence[int]) -> str:
        base = self._tok.get_vocab_size(with_added_tokens=True)
        keep = [int(i) for i in ids if 0 <= int(i) < base and int(i) != self.eos_id]
        return self._tok.decode(keep, skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"HfTokenizer({self.path!r})"


def _eos_from_config(config_path: str) -> str | None:
    if not os.path.exists(config_path):
        return None
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (ValueError, OSError) as e:
        raise UsageError(f"{config_path}: not a readable JSON file ({e})") from None
    eos = config.get("eos_token") if isinstance(config, dict) else None
    return eos.get("content") if isinstance(eos, dict) else eos


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece `.model` file. Needs `pip install sentencepiece` (imported lazily)."""

    def __init__(self, path: str):
        try:
            import sentencepiece
        except ImportError as e:
            raise ImportError(
                f"SentencePiece model {path!r} needs the sentencepiece package: "
                "pip install sentencepiece"
            ) from e
        self.path = path
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=path)
        except (RuntimeError, OSError) as e:
            raise UsageError(
                f"{path}: not a SentencePiece model sentencepiece can read ({one_line(e)})"
            ) from None
        base_size = self._sp.get_piece_size()
        eos = self._sp.eos_id()
        self.eos_id = eos if eos >= 0 else base_size
        self.vocab_size = base_size + (eos < 0)
        num_bytes = np.zeros(self.vocab_size, dtype=np.int64)
        for i in range(base_size):
            if self._sp.is_control(i) or self._sp.is_unknown(i) or i == self.eos_id:
                continue
            piece = self._sp.id_to_piece(i)
            num_bytes[i] = 1 if self._sp.is_byte(i) else len(piece.replace("▁", " ").encode())
        self.token_num_bytes = num_bytes

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        base = self._sp.get_piece_size()
        return self._sp.decode([int(i) for i in ids if 0 <= int(i) < base and i != self.eos_id])

    def __reduce__(self):
        # Rebuild from the path in worker processes (mp_prefetch pickles the pipeline).
        return (SentencePieceTokenizer, (self.path,))

    def __repr__(self) -> str:
        return f"SentencePieceTokenizer({self.path!r})"


def make_tokenizer(spec: str) -> Tokenizer:
    """'byte', a `tokenizer.json` path (or a directory holding one), or a `.model` path.

    Raises UsageError naming the path when it does not exist, UsageError when the file
    kind is not recognised.
    """
    if spec == "byte":
        return ByteTokenizer()
    path = os.path.expanduser(spec)
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if not os.path.exists(path):
        raise UsageError(
            f"tokenizer not found: {path!r} (use 'byte', a tokenizer.json "
            "or a SentencePiece .model path)"
        )
    if path.endswith(".json"):
        return HfTokenizer(path)
    if path.endswith(".model"):
        return SentencePieceTokenizer(path)
    raise UsageError(
        f"unknown tokenizer file {path!r}: expected 'byte', a tokenizer.json or a .model file"
    )
