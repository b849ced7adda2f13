"""eval_main.py --hf_checkpoint end to end: the loss it reports on the reference inputs equals
the loss implied by transformers' own logits for them (tests/hf_reference). A --seq_len past
GPT-2's learned position table is refused in one line."""

from __future__ import annotations

import json
import os

import _entry
import numpy as np
import pytest
from _train_helpers import ROOT, char_tokenizer

from nnx_zoo.data.sources import write_token_documents

REFERENCE = os.path.join(ROOT, "tests", "hf_reference")


def _reference_loss(logits_BTV, input_ids_BT, eos_id):
    """Mean next-token NLL as eval_main counts it: each document is the ids then EOS, so the
    last id's target is EOS, and EOS itself predicts nothing."""
    logits = logits_BTV.astype(np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
    logp -= logits.max(-1, keepdims=True)
    targets = np.concatenate(
        [input_ids_BT[:, 1:], np.full((input_ids_BT.shape[0], 1), eos_id)], axis=1
    )
    return -np.take_along_axis(logp, targets[..., None], -1).mean()


@pytest.mark.parametrize("family,strategy", [("gemma3", "fsdp_tp"), ("gpt2", "dp")])
def test_eval_of_a_hf_checkpoint_equals_the_reference_loss(tmp_path, family, strategy):
    ref = np.load(os.path.join(REFERENCE, family, "inputs_and_logits.npz"))
    ids = ref["input_ids"]
    data = str(tmp_path / "docs.arrayrecord")
    write_token_documents(data, [row for row in ids])
    tokenizer, eos = char_tokenizer(tmp_path, num_ids=128)  # the reference vocab
    args = [
        f"--workdir={tmp_path}",
        f"--hf_checkpoint={os.path.join(REFERENCE, family)}",
        f"--data={data}",
        f"--tokenizer={tokenizer}",
        f"--sharding_strategy={strategy}",
        "--batch_size=8",
        "--eval_batches=1",
    ]
    # One document per row (24 ids + EOS fit 32), two rows: both documents, one batch. GPT-2's
    # learned position table has 32 rows, and without --seq_len the default (512) is cut to
    # it; the other families are given the length.
    if family != "gpt2":
        args.append("--seq_len=32")
    result = _entry.evaluate(args)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(tmp_path / "eval.json") as f:
        report = json.load(f)
    assert report["tokens"] == ids.size  # 24 targets per document: 23 ids and the EOS
    # An HF checkpoint has no step: the printed result names the directory instead.
    hf_dir = os.path.join(REFERENCE, family)
    # After the platform line (nnx_zoo/runtime/host.py).
    assert result.stdout.splitlines()[1].startswith(f"hf checkpoint {hf_dir}: loss "), result.stdout
    assert report["step"] is None and report["non_finite"] == []
    # float32 logits against transformers' (parity tests: within 1e-5), averaged over 48 terms.
    np.testing.assert_allclose(
        report["loss"], _reference_loss(ref["logits"], ids, eos), rtol=1e-5, atol=1e-5
    )


def test_a_length_past_learned_positions_is_refused(tmp_path):
    args = [
        f"--workdir={tmp_path}",
        f"--hf_checkpoint={os.path.join(REFERENCE, 'gpt2')}",
        "--seq_len=64",
        "--tokenizer=byte",  # the reference directory ships no tokenizer.json
    ]
    result = _entry.evaluate(args)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--seq_len=64 is longer than" in lines[0], result.stderr
    assert "max_seq_len=32" in lines[0]
