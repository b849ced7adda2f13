"""Preference pairs (`data.format=preference`): records -> a chosen and a rejected sequence
that share one packed row, each a segment of its own.

Records (JSONL lines or Parquet rows), TRL's preference formats:
  standard         {"prompt": str, "chosen": str, "rejected": str}
  conversational   {"prompt": [messages], "chosen": [messages], "rejected": [messages]}, or
                   without `prompt`: `chosen` and `rejected` are whole conversations that
                   differ only in their last (assistant) message, the rest being the prompt.

Encoded as TRL's DPOTrainer encodes them, so both see the same token ids: a string prompt
is tokenized as transformers calls a tokenizer (BOS first where it adds one), and so is
`prompt + answer`, EOS appended when missing; a conversation is rendered with the
checkpoint's chat template, the prompt with `add_generation_prompt=True`. The answer is
what follows the longest common prefix of the prompt's ids and the whole sequence's, and
the loss reads only its tokens (`loss_mask`).

The chosen sequence and the rejected one go into the same row, next to each other: the
packer sees the pair as one document (so it is never split across rows, and both answers
are in the same batch), and `split_pair_segments` then gives the chosen tokens segment
2k-1 and the rejected ones 2k (k: the pair's place in the row), positions restarting at
each, so attention never crosses from one answer into the other or into another pair.
The steps (nnx_zoo/training/preference.py) read a pair from that layout. A pair longer
than `seq_len` in total follows `data.chat_overflow`: drop, error, or truncate_left (the
same number of tokens cut from the start of both sequences: their shared prompt first).
"""

from __future__ import annotations

import json

import grain
import numpy as np

from nnx_zoo.data import chat
from nnx_zoo.data.tokenizers import Tokenizer
from nnx_zoo.errors import UsageError

FIELDS = ("prompt", "chosen", "rejected")
CHOSEN, REJECTED = 1, 2  # the `side` of each token of a packed pair


def _answer_messages(value, name: str, where: str) -> list[dict]:
    messages = chat._check_messages(value, where)
    for m in messages:
        if not m["content"].strip():
            raise UsageError(f"{where}: the {name} answer is empty (a message with no content)")
    return messages


def check_record(record, where: str) -> dict:
    """The record's prompt / chosen / rejected, checked; UsageError naming `where` if wrong."""
    if not isinstance(record, dict):
        raise UsageError(f"{where}: expected a JSON object, got {json.dumps(record)[:40]}")
    missing = [k for k in ("chosen", "rejected") if record.get(k) is None]
    if missing:
        raise UsageError(
            f"{where}: no {' or '.join(map(repr, missing))} field (data.format=preference "
            f"wants prompt, chosen and rejected; fields here: {sorted(record)})"
        )
    prompt, chosen, rejected = record.get("prompt"), record["chosen"], record["rejected"]
    if isinstance(chosen, str) and isinstance(rejected, str):
        if not isinstance(prompt, str):
            raise UsageError(
                f"{where}: chosen and rejected are strings, so prompt must be one too "
                f"(got {type(prompt).__name__})"
            )
        for name, answer in (("chosen", chosen), ("rejected", rejected)):
            if not answer.strip():
                raise UsageError(f"{where}: the {name} answer is empty")
        return {"prompt": prompt, "chosen": chosen, "rejected": rejected}
    if not (isinstance(chosen, list) and isinstance(rejected, list)):
        raise UsageError(f"{where}: chosen and rejected must both be strings or both message lists")
    chosen = _answer_messages(chosen, "chosen", where)
    rejected = _answer_messages(rejected, "rejected", where)
    if prompt is None:  # implicit prompt: the conversations' shared beginning
        if len(chosen) < 2 or len(rejected) < 2:
            raise UsageError(
                f"{where}: without a 'prompt' field, chosen and rejected must be whole "
                "conversations (the prompt's messages, then the answer)"
            )
        shared_c, shared_r = chosen[:-1], rejected[:-1]
        if shared_c != shared_r:
            at = next(
                (i for i, (c, r) in enumerate(zip(shared_c, shared_r, strict=False)) if c != r),
                min(len(shared_c), len(shared_r)),
            )
            raise UsageError(
                f"{where}: the prompts of chosen and rejected differ (at message {at}); a "
                "pair answers one prompt"
            )
        prompt, chosen, rejected = shared_c, chosen[-1:], rejected[-1:]
    elif not isinstance(prompt, list):
        raise UsageError(f"{where}: chosen and rejected are message lists, so prompt must be one")
    else:
        prompt = chat._check_messages(prompt, where) if prompt else []
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _with_specials(tokenizer: Tokenizer, text: str, specials: list[int]) -> list[int]:
    ids = tokenizer.encode(text)
    return ids if ids[: len(specials)] == specials else specials + ids


def encode_pair(record: dict, tokenizer: Tokenizer, template, where: str) -> dict:
    """{'tokens', 'loss_mask', 'side'} of one checked record: the chosen sequence, then the
    rejected one (int32 arrays); UsageError naming `where` when an answer encodes to nothing."""
    if isinstance(record["prompt"], str):
        specials = chat.leading_specials(tokenizer)
        prompt = _with_specials(tokenizer, record["prompt"], specials)
        sequences = []
        for side in ("chosen", "rejected"):
            ids = _with_specials(tokenizer, record["prompt"] + record[side], specials)
            if not ids or ids[-1] != tokenizer.eos_id:
                ids.append(tokenizer.eos_id)
            sequences.append(ids)
    else:
        if template is None:
            raise UsageError(f"{where}: message lists need the checkpoint's chat template")
        prompt = tokenizer.encode(template.render(record["prompt"], add_generation_prompt=True))
        sequences = [
            tokenizer.encode(template.render(record["prompt"] + record[side]))
            for side in ("chosen", "rejected")
        ]
    # As TRL: the answer starts where the prompt's ids and the sequence's part (a template
    # may render a prompt alone differently, or tokens may merge across the boundary).
    prompt_len = min(_common_prefix(prompt, ids) for ids in sequences)
    for side, ids in zip(("chosen", "rejected"), sequences, strict=True):
        if len(ids) <= prompt_len:
            raise UsageError(f"{where}: the {side} answer encodes to no tokens")
    tokens = np.asarray(sequences[0] + sequences[1], np.int32)
    mask = np.concatenate([np.arange(len(ids)) >= prompt_len for ids in sequences]).astype(np.int32)
    side = np.repeat([CHOSEN, REJECTED], [len(s) for s in sequences]).astype(np.int32)
    return {"tokens": tokens, "loss_mask": mask, "side": side}


def _fit(encoded: dict, seq_len: int, overflow: str, where: str) -> dict | None:
    """The pair within `seq_len` tokens by the overflow policy; None: left out."""
    length = len(encoded["tokens"])
    if length <= seq_len:
        return encoded
    if overflow == "error":
        raise UsageError(
            f"{where}: the pair is {length} tokens (chosen and rejected share one row), more "
            f"than data.seq_len={seq_len}; raise data.seq_len, or set data.chat_overflow=drop "
            "or truncate_left"
        )
    if overflow == "drop":
        return None
    # truncate_left: the same count off the start of both sequences, so the two keep the
    # same (shortened) prompt; a side left without answer tokens drops the pair.
    cut = -(-(length - seq_len) // 2)
    side = encoded["side"]
    keep = np.ones(length, bool)
    for s in (CHOSEN, REJECTED):
        at = np.flatnonzero(side == s)
        if len(at) <= cut:
            return None
        keep[at[:cut]] = False
    out = {k: v[keep] for k, v in encoded.items()}
    if len(out["tokens"]) > seq_len:  # odd excess: one more off the longer side's start
        n_chosen, n_rejected = ((out["side"] == s).sum() for s in (CHOSEN, REJECTED))
        longer = CHOSEN if n_chosen >= n_rejected else REJECTED
        keep = np.ones(len(out["tokens"]), bool)
        keep[np.flatnonzero(out["side"] == longer)[0]] = False
        out = {k: v[keep] for k, v in out.items()}
    for s in (CHOSEN, REJECTED):
        if not out["loss_mask"][out["side"] == s].any():
            return None
    return out


def encode_records(
    source: str,
    split: str,
    validation_fraction: float,
    tokenizer: Tokenizer,
    template,
    *,
    seq_len: int,
    overflow: str = "drop",
    notes: list[str] | None = None,
) -> grain.MapDataset:
    """The pairs of `source` in `split`, encoded (`encode_pair`) and fitted to `seq_len`;
    every record is checked here, while the run is built, so a bad one stops the run
    before the first step, naming its file and line (or row)."""
    if overflow not in chat.OVERFLOW:
        raise UsageError(f"data.chat_overflow={overflow!r}; valid: {', '.join(chat.OVERFLOW)}")
    keyed = chat.keyed_records(
        source, split, "preference", validation_fraction, check=check_record, fields=FIELDS
    )
    kept, dropped, longest = [], 0, 0
    for where, record in keyed:
        encoded = encode_pair(record, tokenizer, template, where)
        fitted = _fit(encoded, seq_len, overflow, where)
        if fitted is None:
            dropped += 1
            longest = max(longest, len(encoded["tokens"]))
            continue
        kept.append(fitted)
    where = f"data.source={source!r} ({split} split)"
    if not kept:
        raise UsageError(
            f"{where}: nothing to train on: all {len(keyed)} pairs are longer than "
            f"data.seq_len={seq_len} (chosen and rejected share one row; the longest pair "
            f"{longest} tokens; data.chat_overflow={overflow})"
        )
    if dropped and notes is not None:
        notes.append(
            f"{where}: left out {dropped} of {len(keyed)} pairs longer than data.seq_len="
            f"{seq_len} (the longest {longest} tokens; data.chat_overflow={overflow})"
        )
    return grain.MapDataset.source(kept)


def split_pair_segments(row: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A packed row of pairs (grain's `tokens_segment_ids`: one per pair, and `side`) ->
    `tokens`, `segment_ids` (chosen 2k-1, rejected 2k, padding 0), `positions` (from 0 in
    each sequence) and `loss_mask`, int32."""
    pair = row["tokens_segment_ids"].astype(np.int32)
    side = row["side"]
    segment = np.where(pair > 0, 2 * pair - (side == CHOSEN), 0).astype(np.int32)
    index = np.arange(len(segment))
    starts = np.r_[True, segment[1:] != segment[:-1]]
    positions = index - np.maximum.accumulate(np.where(starts, index, 0))
    return {
        "tokens": row["tokens"].astype(np.int32),
        "segment_ids": segment,
        "positions": np.where(segment > 0, positions, 0).astype(np.int32),
        "loss_mask": row["loss_mask"].astype(np.int32),
    }
