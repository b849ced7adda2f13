"""Chat and instruction data: records -> the checkpoint's chat template -> token ids + a loss mask.

Formats (`data.format`):
  chat               each record has `messages`: a list of {role, content} (OpenAI / HF style).
  prompt_completion  each record has `prompt` and `completion`: strings (the prompt as the
                     tokenizer encodes a text, BOS first where it adds one, as transformers
                     and TRL do; then the completion's ids and EOS) or lists of messages
                     (rendered as a chat).

Records are JSONL lines or Parquet rows. A chat is rendered with the checkpoint's own
`chat_template` (`chat_template.jinja`, else `chat_template` in `tokenizer_config.json`, beside
the tokenizer) in Jinja's ImmutableSandboxedEnvironment with the names transformers gives it
(`raise_exception`, `strftime_now`, the `tojson` filter, the special tokens `bos_token`,
`eos_token`, ..., `add_generation_prompt`), so the text, and its token ids, are those of
transformers' `apply_chat_template(messages, tokenize=True)`. A template is code that came
with a download: the sandbox stops it reaching outside, and any error it raises becomes one
UsageError line.

The loss mask is per token: 1 on the tokens of the assistant messages (their content and the
end-of-turn marker the template writes after it, so the model learns to stop), or of the
completion; 0 elsewhere. A token belongs to the span in which its first character lies.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Sequence

import grain
import numpy as np

from nnx_zoo.data import sources, token_store
from nnx_zoo.data.tokenizers import Tokenizer
from nnx_zoo.errors import UsageError
from nnx_zoo.runtime.console import one_line

FORMATS = ("text", "chat", "prompt_completion")
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token")


class ChatTemplate:
    """A Jinja chat template rendered as transformers renders it."""

    def __init__(self, template: str, special_tokens: dict[str, str] | None = None, *, source=""):
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        self.source = source or "chat_template"
        self.special_tokens = dict(special_tokens or {})

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            # transformers' filter: Jinja's own escapes HTML characters
            return json.dumps(
                x,
                ensure_ascii=ensure_ascii,
                indent=indent,
                separators=separators,
                sort_keys=sort_keys,
            )

        def strftime_now(fmt):
            return datetime.datetime.now().strftime(fmt)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[_generation_tag(), jinja2.ext.loopcontrols],
        )
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = strftime_now
        try:
            self._template = env.from_string(template)
        except jinja2.exceptions.TemplateError as e:
            raise UsageError(f"{self.source}: not a valid Jinja template ({one_line(e)})") from None

    @classmethod
    def from_dir(cls, path: str) -> ChatTemplate:
        """The template of a tokenizer directory (or of the directory of a tokenizer.json)."""
        directory = path if os.path.isdir(path) else os.path.dirname(path)
        config_path = os.path.join(directory, "tokenizer_config.json")
        config = {}
        if os.path.exists(config_path):
            with open(config_path, encoding="utf-8") as f:
                config = json.load(f)
        special = {}
        for name in _SPECIAL_TOKENS:
            token = config.get(name)
            token = token.get("content") if isinstance(token, dict) else token
            if isinstance(token, str):
                special[name] = token
        jinja_path = os.path.join(directory, "chat_template.jinja")
        if os.path.exists(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                return cls(f.read(), special, source=jinja_path)
        template = config.get("chat_template")
        if isinstance(template, list):  # [{name, template}, ...]: the default one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if not isinstance(template, str):
            raise UsageError(
                f"{directory!r} has no chat template (chat_template.jinja, or chat_template in "
                "tokenizer_config.json); data.format=chat needs the checkpoint's tokenizer "
                "directory (--config.data.tokenizer=DIR)"
            )
        return cls(template, special, source=config_path)

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = False, **kwargs):
        """The template's text for `messages`; UsageError (one line) when the template raises."""
        import jinja2

        # transformers drops keys whose value is None before rendering.
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                **{**self.special_tokens, **kwargs},
            )
        except jinja2.exceptions.SecurityError as e:
            raise UsageError(
                f"{self.source}: the chat template tried to reach outside its sandbox "
                f"({one_line(e)})"
            ) from None
        except Exception as e:  # noqa: BLE001 -- a template is foreign code; any error is its
            raise UsageError(f"{self.source}: the chat template raised: {one_line(e)}") from None

    def assistant_spans(
        self, messages: Sequence[dict], trained: Sequence[bool]
    ) -> tuple[str, list[tuple[int, int]]]:
        """(text, [(start, end)] character spans of the messages flagged in `trained`).

        Each message's content is found in the text in order (a template may trim it); a
        trained message's span runs on over what the template writes right after the content
        when that message ends a conversation (its end-of-turn marker).
        """
        text = self.render(messages)
        self._check_every_message_renders(messages)
        spans, cursor = [], 0
        for i, (message, train) in enumerate(zip(messages, trained, strict=True)):
            content = message["content"]
            start, found = _find(text, content, cursor)
            if start < 0:
                raise UsageError(
                    f"{self.source}: the content of message {i} (role {message['role']!r}) is "
                    "not in the rendered chat (the template drops or rewrites it), so its tokens "
                    "cannot be told apart"
                )
            end = start + len(found)
            cursor = end
            if not train:
                continue
            alone = self.render(messages[: i + 1])
            tail_at = alone.rfind(found) + len(found) if found else len(alone)
            tail = alone[tail_at:]
            if tail and text.startswith(tail, end):
                end += len(tail)
            spans.append((start, end))
        return text, spans

    def _check_every_message_renders(self, messages: Sequence[dict]) -> None:
        """UsageError (one line) naming the first message the template renders nothing of.

        The template is the judge of roles: each content is swapped for a marker, and a
        message whose marker is not in the text, and without which the text is the same, was
        dropped (a role the template does not know). One whose content is left out but that
        renders something (an assistant turn holding only a tool call) is not. The error
        lists the roles that would render in its place.
        """
        marked = _with_markers(messages)
        text = self.render(marked)
        for i, message in enumerate(marked):
            if message["content"] in text or not self._same_without(marked, i, text):
                continue
            role = message["role"]
            known = [r for r in _COMMON_ROLES if r != role and self._renders(marked, i, r)]
            raise UsageError(
                f"{self.source}: message {i} has role {role!r}, which the chat template does "
                f"not know (it renders nothing of that message); roles it renders there: "
                f"{', '.join(known) or 'none of ' + ', '.join(_COMMON_ROLES)}"
            )

    def _same_without(self, marked: list[dict], i: int, text: str) -> bool:
        try:
            return self.render([*marked[:i], *marked[i + 1 :]]) == text
        except ValueError:  # it needs that message to render at all: not dropped
            return False

    def _renders(self, marked: list[dict], i: int, role: str) -> bool:
        trial = [*marked[:i], {**marked[i], "role": role}, *marked[i + 1 :]]
        try:
            return marked[i]["content"] in self.render(trial)
        except ValueError:
            return False


# Only to name alternatives in an error: the template decides which roles a chat may hold.
_COMMON_ROLES = ("system", "developer", "user", "assistant", "tool", "ipython")


def _with_markers(messages: Sequence[dict]) -> list[dict]:
    """`messages` with each content replaced by a marker that no other text contains."""
    return [{**m, "content": f"<<zoo-message-{i}>>"} for i, m in enumerate(messages)]


def _find(text: str, content: str, cursor: int) -> tuple[int, str]:
    """(index, the form found) of `content` (or its stripped form) in text from cursor."""
    for form in (content, content.strip()):
        at = text.find(form, cursor)
        if at >= 0:
            return at, form
    return -1, content


def _generation_tag():
    """transformers' `{% generation %}` block tag, rendering its body as it is, so that
    templates written for assistant masks parse here too."""
    import jinja2.ext
    import jinja2.nodes

    class GenerationTag(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body)
            return call.set_lineno(lineno)

        def _body(self, caller):
            return caller()

    return GenerationTag


# ----------------------------------------------------------------------------- records


def _check_messages(messages, where: str) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise UsageError(f"{where}: 'messages' must be a non-empty list of {{role, content}}")
    out = []
    for j, m in enumerate(messages):
        # Which roles a chat may hold is the template's to say (Llama 3.1 knows `ipython`,
        # OpenAI-style templates `developer`): ChatTemplate.assistant_spans refuses a message
        # the template raises on or renders nothing of.
        role, content = (m.get("role"), m.get("content")) if isinstance(m, dict) else (0, 0)
        if not (isinstance(role, str) and role and isinstance(content, str)):
            raise UsageError(
                f"{where}: message {j} must be an object with a string 'role' and a string "
                "'content'"
            )
        out.append(dict(m))
    return out


def check_record(record, data_format: str, where: str) -> dict:
    """The record's fields for `data_format`, checked; UsageError naming `where` if wrong."""
    if not isinstance(record, dict):
        raise UsageError(f"{where}: expected a JSON object, got {json.dumps(record)[:40]}")
    if data_format == "chat":
        if "messages" not in record:
            raise UsageError(
                f"{where}: no 'messages' field (data.format=chat wants "
                '{"messages": [{"role": ..., "content": ...}, ...]}; fields here: '
                f"{sorted(record)})"
            )
        return {"messages": _check_messages(record["messages"], where)}
    missing = [k for k in ("prompt", "completion") if k not in record]
    if missing:
        raise UsageError(
            f"{where}: no {' or '.join(map(repr, missing))} field (data.format="
            f"prompt_completion wants prompt and completion; fields here: {sorted(record)})"
        )
    prompt, completion = record["prompt"], record["completion"]
    if isinstance(prompt, str) and isinstance(completion, str):
        return {"prompt": prompt, "completion": completion}
    if isinstance(prompt, list) and isinstance(completion, list):
        return {
            "prompt": _check_messages(prompt, where) if prompt else [],
            "completion": _check_messages(completion, where),
        }
    raise UsageError(f"{where}: prompt and completion must both be strings or both message lists")


def _read_records(path: str, data_format: str, check=None, fields=None) -> list[dict]:
    if check is None:
        fields = ("messages",) if data_format == "chat" else ("prompt", "completion")

        def check(record, where):
            return check_record(record, data_format, where)

    if path.endswith(".jsonl"):
        return [
            check(record, f"{path}:{line_no}") for line_no, record in sources.jsonl_records(path)
        ]
    if path.endswith(".parquet"):
        import pyarrow
        import pyarrow.parquet as pq

        try:
            names = pq.read_schema(path).names
            # (a preference record's prompt may be left out: then its conversations hold it)
            missing = [f for f in fields if f not in names and f != "prompt"]
            if missing:
                raise UsageError(
                    f"{path}: no column {missing[0]!r} (data.format={data_format} wants "
                    f"{', '.join(fields)}; columns: {names})"
                )
            rows = pq.read_table(path, columns=[f for f in fields if f in names]).to_pylist()
        except pyarrow.ArrowException as e:
            raise UsageError(f"{path}: not a readable Parquet file ({one_line(e)})") from None
        return [check(r, f"{path}: row {i}") for i, r in enumerate(rows)]
    raise UsageError(
        f"data file {path!r}: data.format={data_format} reads .jsonl or .parquet records"
    )


def load_records(
    source: str, split: str, data_format: str, validation_fraction: float
) -> grain.MapDataset:
    """The checked records of `source` in `split` (the same hash split as text documents)."""
    return grain.MapDataset.source(
        [r for _, r in keyed_records(source, split, data_format, validation_fraction)]
    )


def keyed_records(
    source: str, split: str, data_format: str, validation_fraction: float, check=None, fields=None
) -> list[tuple[str, dict]]:
    """(where, record): `where` names the file and line (JSONL) or row (Parquet). `check(record,
    where)` and the Parquet columns `fields` are the format's (default: chat's)."""
    if split not in sources.SPLITS:
        raise UsageError(f"unknown split {split!r}; expected one of {sources.SPLITS}")
    if source == sources.DEFAULT_SOURCE:
        raise UsageError(
            f"data.format={data_format} needs a data.source of .jsonl or .parquet records, "
            "not 'default'"
        )
    keyed = [
        (path, i, record)
        for path in sources._expand(source)
        for i, record in enumerate(_read_records(path, data_format, check, fields))
    ]
    in_val = np.array(
        [
            sources._in_validation(f"{os.path.basename(path)}:{i}", validation_fraction)
            for path, i, _ in keyed
        ],
        dtype=bool,
    )
    kept = [
        (f"{path} record {i + 1}", r)
        for (path, i, r), keep in zip(keyed, sources._keep(in_val, split), strict=True)
        if keep
    ]
    if not kept:
        raise UsageError(sources._no_documents(source, split, len(keyed), validation_fraction))
    return kept


# What a record longer than seq_len becomes (data.chat_overflow; training/config.py's
# CHAT_OVERFLOW): never split into rows, which would train an answer without its prompt.
OVERFLOW = ("drop", "truncate_left", "error")


def encode_records(
    source: str,
    split: str,
    data_format: str,
    validation_fraction: float,
    tokenizer: Tokenizer,
    template: ChatTemplate | None,
    *,
    seq_len: int,
    overflow: str = "drop",
    notes: list[str] | None = None,
) -> grain.MapDataset:
    """The records of `source` in `split`, encoded ({'tokens', 'loss_mask'}), each at most
    `seq_len` tokens by the `overflow` policy, and only those holding a trained token.

    Every record is encoded here, once, while the run is built: a template that raises, a
    role it does not know, a record too long under `overflow='error'`, and a split with no
    trained token at all (conversations without an assistant turn: the loss would be 0 and
    the gradient nothing) are each a UsageError (one line) before the first step. What was
    dropped or cut is counted in one line appended to `notes`."""
    if overflow not in OVERFLOW:
        raise UsageError(f"data.chat_overflow={overflow!r}; valid: {', '.join(OVERFLOW)}")
    if token_store.is_store(source):  # encoded by zoo-data: read, not rendered again
        encoded_records = _store_records(source, split, data_format, validation_fraction)
    else:
        encoded_records = [
            (where, encode_record(record, tokenizer, template))
            for where, record in keyed_records(source, split, data_format, validation_fraction)
        ]
    keyed = encoded_records
    kept, too_long, cut, untrained, longest = [], 0, 0, 0, 0
    for where, encoded in encoded_records:
        length = len(encoded["tokens"])
        if length > seq_len:
            longest = max(longest, length)
            if overflow == "error":
                raise UsageError(
                    f"{where}: {length} tokens, more than data.seq_len={seq_len}; raise "
                    "data.seq_len, or set data.chat_overflow=drop (leave such records out) or "
                    "truncate_left (keep their last seq_len tokens)"
                )
            if overflow == "drop":
                too_long += 1
                continue
            encoded = {k: v[-seq_len:] for k, v in encoded.items()}
            cut += 1
        if not encoded["loss_mask"].any():
            untrained += 1
            continue
        kept.append(encoded)
    what = "conversations" if data_format == "chat" else "records"
    where = f"data.source={source!r} ({split} split)"
    if not kept:
        reasons = []
        if untrained:
            trained = "assistant turn" if data_format == "chat" else "completion"
            reasons.append(f"{untrained} hold no trained token (no {trained} to learn)")
        if too_long:
            reasons.append(
                f"{too_long} are longer than data.seq_len={seq_len} (the longest {longest} "
                "tokens; data.chat_overflow=drop)"
            )
        raise UsageError(
            f"{where}: nothing to train on: of its {len(keyed)} {what}, {'; '.join(reasons)}"
        )
    counts = []
    if too_long:
        counts.append(
            f"dropped {too_long} of {len(keyed)} {what} longer than data.seq_len={seq_len} "
            f"(the longest {longest} tokens; data.chat_overflow=drop)"
        )
    if cut:
        counts.append(
            f"kept the last {seq_len} tokens of {cut} of {len(keyed)} {what} longer than "
            f"data.seq_len (the longest {longest}; data.chat_overflow=truncate_left)"
        )
    if untrained:
        counts.append(f"left out {untrained} {what} with no trained token")
    if counts and notes is not None:
        notes.append(f"{where}: {'; '.join(counts)}")
    return grain.MapDataset.source(kept)


def _store_records(source, split, data_format, validation_fraction) -> list[tuple[str, dict]]:
    """(where, {'tokens', 'loss_mask'}) of a chat / prompt_completion token store's split."""
    store = token_store.TokenStore(source)
    if store.index["data_format"] != data_format:
        raise UsageError(
            f"data.source={source!r} holds {store.index['data_format']} data; set "
            f"--config.data.format={store.index['data_format']}"
        )
    number = np.arange(len(store), dtype=np.int64)
    in_val = sources._both_sides(sources._index_in_validation(number, validation_fraction))
    kept = number[sources._keep(in_val, split)]
    if not len(kept):
        raise UsageError(sources._no_documents(source, split, len(store), validation_fraction))
    return [
        (f"{source} record {int(n) + 1}", {"tokens": ids, "loss_mask": mask})
        for n, (ids, mask) in zip(kept, store.read(kept), strict=True)
    ]


# ----------------------------------------------------------------------------- encoding


def _token_mask(tokenizer: Tokenizer, text: str, spans) -> tuple[np.ndarray, np.ndarray]:
    ids, starts = tokenizer.encode_with_starts(text)
    mask = np.zeros(len(ids), np.int32)
    for start, end in spans:
        mask[(starts >= start) & (starts < end)] = 1
    return np.asarray(ids, np.int32), mask


def encode_record(record: dict, tokenizer: Tokenizer, template: ChatTemplate | None):
    """{'tokens': int32 ids, 'loss_mask': int32 0/1 per token} of one checked record."""
    if "messages" in record or isinstance(record.get("prompt"), list):
        if template is None:
            raise UsageError("chat records need the checkpoint's chat template")
        if "messages" in record:
            messages = record["messages"]
            trained = [m["role"] == "assistant" for m in messages]
        else:
            messages = record["prompt"] + record["completion"]
            trained = [False] * len(record["prompt"]) + [True] * len(record["completion"])
        text, spans = template.assistant_spans(messages, trained)
        ids, mask = _token_mask(tokenizer, text, spans)
    else:
        prompt = tokenizer.encode(record["prompt"])
        specials = leading_specials(tokenizer)
        if prompt[: len(specials)] != specials:  # (a prompt that starts with BOS gets no second)
            prompt = specials + prompt
        completion = tokenizer.encode(record["completion"])
        ids = np.asarray([*prompt, *completion, tokenizer.eos_id], np.int32)
        mask = np.concatenate([np.zeros(len(prompt)), np.ones(len(completion) + 1)])
    return {"tokens": ids, "loss_mask": mask.astype(np.int32)}


def leading_specials(tokenizer: Tokenizer) -> list[int]:
    """The ids the tokenizer puts before a text when it is called as transformers calls it
    (`add_special_tokens=True`, what TRL does with a prompt that has no chat template): BOS
    for Llama- and Gemma-style tokenizers, nothing for GPT-2- and Qwen-style ones or bytes.
    A rendered chat needs none: its template writes the BOS text itself."""
    from nnx_zoo.data.tokenizers import HfTokenizer, SentencePieceTokenizer

    if isinstance(tokenizer, HfTokenizer):
        # What the post-processor adds in front of a one-character text.
        plain = tokenizer._tok.encode("a", add_special_tokens=False).ids
        full = tokenizer._tok.encode("a", add_special_tokens=True).ids
        for at in range(len(full) - len(plain) + 1):
            if full[at : at + len(plain)] == plain:
                return full[:at]
        return []
    if isinstance(tokenizer, SentencePieceTokenizer):  # transformers adds its BOS by default
        bos = tokenizer._sp.bos_id()
        return [bos] if bos >= 0 else []
    return []
