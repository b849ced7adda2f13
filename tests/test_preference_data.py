"""Preference pairs as data (issue 51, item 1 and check 3): records checked one by one, a bad
one a one-line error naming its file and line (exit 2 from train_main); both sequences of a
pair in one row as segments of their own, whose packed log probabilities equal each sequence
run alone; a pair longer than seq_len by data.chat_overflow."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnx_zoo.data import preference
from nnx_zoo.data.tokenizers import make_tokenizer
from nnx_zoo.errors import UsageError

GOOD = {"prompt": "Which sea?", "chosen": " The wide blue one.", "rejected": " No."}
CONVERSATION = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
BAD = {
    "missing_rejected": ({"prompt": "Which sea?", "chosen": " The blue one."}, "'rejected'"),
    "empty_answer": ({**GOOD, "chosen": "  "}, "chosen answer is empty"),
    "empty_message": (
        {
            "prompt": [{"role": "user", "content": "Hi"}],
            "chosen": [{"role": "assistant", "content": "Hello!"}],
            "rejected": [{"role": "assistant", "content": ""}],
        },
        "rejected answer is empty",
    ),
    "prompts_differ": (
        {
            "chosen": CONVERSATION,
            "rejected": [{"role": "user", "content": "Hey"}, CONVERSATION[1]],
        },
        "prompts of chosen and rejected differ (at message 0)",
    ),
    "mixed_kinds": ({**GOOD, "rejected": CONVERSATION}, "must both be strings or both message"),
}


def _write(path, records) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return str(path)


def _encode(source, seq_len=256, overflow="drop", notes=None):
    return preference.encode_records(
        source,
        "all",
        0.02,
        make_tokenizer("byte"),
        None,
        seq_len=seq_len,
        overflow=overflow,
        notes=notes,
    )


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_record_is_one_line_naming_its_file_and_line(case, tmp_path):
    record, why = BAD[case]
    source = _write(tmp_path / "pairs.jsonl", [GOOD, GOOD, record, GOOD])
    with pytest.raises(UsageError) as e:
        _encode(source)
    message = str(e.value)
    assert message.startswith(f"{source}:3: ") and why in message and "\n" not in message


def test_train_main_exits_2_naming_the_record(tmp_path):
    from _train_helpers import SMALL_RUN, cli_flags, run_train_main

    source = _write(tmp_path / "pairs.jsonl", [GOOD, BAD["missing_rejected"][0]])
    result = run_train_main(
        [
            "--config=configs/tiny.py",
            f"--workdir={tmp_path / 'run'}",
            "--sharding_strategy=dp",
            *cli_flags({**SMALL_RUN, "training.steps": 1, "optimizer.warmup_steps": 0}),
            f"--config.data.source={source}",
            "--config.data.format=preference",
            "--config.training.objective=dpo",
        ]
    )
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{source}:2: no 'rejected' field" in lines[0], lines


def test_objective_and_format_go_together():
    from _train_helpers import run_config

    with pytest.raises(UsageError, match="dpo, orpo and simpo train on data.format=preference"):
        run_config({"training.objective": "dpo"})
    with pytest.raises(UsageError, match="data.format=preference trains with dpo, orpo or simpo"):
        run_config({"data.format": "preference"})


def test_overflow_policies(tmp_path):
    # byte ids: 10 + 7 (chosen, EOS) and 10 + 4 (rejected): a pair of 31 tokens
    record = {"prompt": "0123456789", "chosen": "abcdef", "rejected": "xyz"}
    source = _write(tmp_path / "pairs.jsonl", [record, {**record, "prompt": "01"}])
    notes = []
    assert len(_encode(source, seq_len=30, notes=notes)) == 1  # drop: the long one left out
    assert "left out 1 of 2 pairs longer than data.seq_len=30" in notes[0]
    with pytest.raises(UsageError, match=r"pairs.jsonl record 1: the pair is 31 tokens"):
        _encode(source, seq_len=30, overflow="error")
    cut = _encode(source, seq_len=25, overflow="truncate_left")[0]
    side, tokens = cut["side"], cut["tokens"]
    assert len(tokens) == 25  # 3 off each start: the shared prompt loses the same tokens
    tok = make_tokenizer("byte")
    assert tok.decode(tokens[side == 1]) == "3456789abcdef"
    assert tok.decode(tokens[side == 2]) == "3456789xyz"


def _pairs(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    words = ["sea", "blue", "wide", "deep", "Paris", "poem", "the", "is"]

    def text(k):
        return " " + " ".join(rng.choice(words, k))

    return [
        {"prompt": text(2 + i % 4), "chosen": text(1 + i % 3), "rejected": text(1 + (i + 1) % 5)}
        for i in range(n)
    ]


def test_packed_pairs_equal_each_sequence_alone(tmp_path):
    """Pairs packed several to a row give each sequence the answer log probability it has
    alone in a row: attention crosses neither between the chosen and the rejected sequence
    nor between pairs, and positions restart at each."""
    from nnx_zoo import data
    from nnx_zoo.training.preference import pair_logps
    from shardings import get_strategy
    from zoo import create_model, get_config

    records = _pairs(12)
    source = _write(tmp_path / "pairs.jsonl", records)
    tok = make_tokenizer("byte")
    batches = data.build_dataset(
        source, "all", tok, 160, 6, data_format="preference", num_batches=1
    )
    batch = next(iter(batches))
    per_row = batch["segment_ids"].max(axis=1)
    assert (per_row[per_row > 0] >= 4).all()  # rows hold several pairs each
    strategy = get_strategy("dp")
    mesh = strategy.make_mesh(devices=jax.devices()[:1])
    cfg = get_config("tiny", hidden_dim=32, num_layers=2, head_dim=8, ffn_dim=64, vocab_size=256)
    with jax.set_mesh(mesh):
        model = create_model(cfg, strategy, rngs=nnx.Rngs(0))

        @jax.jit
        def packed(model, b):
            nll, mask, _ = model.token_nll(
                b["tokens"], segment_ids=b["segment_ids"], positions=b["positions"]
            )
            out = pair_logps(nll, mask, b)
            return out.chosen_BT, out.rejected_BT, out.end_BT

        got_c, got_r, end = packed(model, {k: jnp.asarray(v) for k, v in batch.items()})
        end = np.asarray(end)
        got = sorted(zip(np.asarray(got_c)[end], np.asarray(got_r)[end], strict=True))
        # Each sequence alone: one per row from position 0, then padding.
        rows = {k: np.zeros((2 * len(records), 160), np.int32) for k in batch}
        for i, record in enumerate(records):
            enc = preference.encode_pair(record, tok, None, "here")
            for j, side in enumerate((preference.CHOSEN, preference.REJECTED)):
                ids, answer = (enc[k][enc["side"] == side] for k in ("tokens", "loss_mask"))
                row, n = 2 * i + j, len(ids)
                rows["tokens"][row, :n], rows["loss_mask"][row, :n] = ids, answer
                rows["segment_ids"][row, :n], rows["positions"][row, :n] = 1, np.arange(n)

        @jax.jit
        def alone(model, b):
            nll, mask, _ = model.token_nll(
                b["tokens"], segment_ids=b["segment_ids"], positions=b["positions"]
            )
            target_is_answer = jnp.roll(b["loss_mask"], -1, axis=1) != 0
            return -jnp.sum(jnp.where(mask & target_is_answer, nll, 0.0), axis=1)

        each = np.asarray(alone(model, {k: jnp.asarray(v) for k, v in rows.items()}))
    np.testing.assert_allclose(
        np.array(got), np.array(sorted(each.reshape(-1, 2).tolist())), rtol=1e-5
    )
