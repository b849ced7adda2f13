"""Preference objectives against TRL (issue 51, goal 1): one batch of pairs on a tiny Llama
exported to Hugging Face, float32.

DPO: TRL's own `DPOTrainer` (its tokenization, collator, policy and reference forwards and
sigmoid loss) against this project's data pipeline and `training.preference.loss_sum`: the
loss and TRL's logged metrics, for plain-text and conversational pairs. SimPO and ORPO live
in `trl.experimental` (CPOTrainer with loss_type='simpo', ORPOTrainer): their loss functions
(`cpo_loss`, `odds_ratio_loss`) are called on TRL's `get_batch_logps` of the torch model over
the DPO-collated batch, ORPO's NLL as ORPOTrainer's `concatenated_forward` computes it.
"""

from __future__ import annotations

import json
import os
import shutil
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

trl = pytest.importorskip("trl", reason="trl is not installed (pip install trl; the hf extra)")
torch = pytest.importorskip("torch", reason="TRL runs on torch (the hf extra)")

from chat_fixtures import write_tokenizer_dir  # noqa: E402

from bench.fixtures import write_tiny_llama  # noqa: E402

PAIRS = [
    {"prompt": "What is the capital of France?", "chosen": " Paris is the capital.",
     "rejected": " Rome, I think."},
    {"prompt": "Write a poem about the sea.", "chosen": " The sea is wide and deep.",
     "rejected": " No."},
    {"prompt": "Hello there!", "chosen": " How are you doing today?",
     "rejected": " user assistant system"},
    {"prompt": "def add(a, b):", "chosen": "\n    return a + b", "rejected": "\n    return a - b"},
]  # fmt: skip
CONVERSATIONAL = [
    {
        "prompt": [{"role": "user", "content": p["prompt"]}],
        "chosen": [{"role": "assistant", "content": p["chosen"].strip()}],
        "rejected": [{"role": "assistant", "content": p["rejected"].strip()}],
    }
    for p in PAIRS
]
BETA = 0.1
# float32 on both sides; the sums differ only by reassociation (measured: rel <= 6e-6).
RTOL = 1e-4


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """A policy (tiny Llama with the Llama 3 chat template) and a reference whose weights
    differ from it by N(0, 0.01): DPO's rewards are then not all zero."""
    return _policy_and_reference(tmp_path_factory.mktemp("preference_trl"), "tiny")


def _policy_and_reference(root, preset: str) -> dict:
    from safetensors.numpy import load_file, save_file

    policy, reference = str(root / "policy"), str(root / "reference")
    write_tiny_llama(policy, "llama", max_seq_len=256, preset=preset)
    write_tokenizer_dir(policy, "llama3")
    shutil.copytree(policy, reference)
    weights = load_file(os.path.join(policy, "model.safetensors"))
    rng = np.random.default_rng(1)
    moved = {k: (v + rng.normal(0, 0.01, v.shape)).astype(v.dtype) for k, v in weights.items()}
    save_file(moved, os.path.join(reference, "model.safetensors"), metadata={"format": "pt"})
    return {"policy": policy, "reference": reference, "root": root}


def _torch_model(path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )


def _trl_dpo(dirs, records, tmp_path):
    """TRL's loss and metrics on `records` as one batch, and the collated batch."""
    import datasets
    import transformers

    args = trl.DPOConfig(
        output_dir=str(tmp_path / "trl"),
        beta=BETA,
        max_length=None,
        per_device_train_batch_size=len(records),
        use_cpu=True,
        bf16=False,  # else the reference's forward runs under bfloat16 autocast
        report_to="none",
        save_strategy="no",
    )
    trainer = trl.DPOTrainer(
        model=_torch_model(dirs["policy"]),
        ref_model=_torch_model(dirs["reference"]),
        args=args,
        train_dataset=datasets.Dataset.from_list(records),
        processing_class=transformers.AutoTokenizer.from_pretrained(dirs["policy"]),
    )
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(records))])
    trainer.model.train()
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch)
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    return {"loss": float(loss), **metrics}, batch, trainer.model


def _ours(dirs, records, tmp_path, objective, model=None, mesh=None):
    """This project's loss and metrics on `records`: its data pipeline, its model (the
    policy directory's, or `model`)."""
    from nnx_zoo import data
    from nnx_zoo.data.chat import ChatTemplate
    from nnx_zoo.data.tokenizers import make_tokenizer
    from nnx_zoo.training import preference
    from shardings import get_strategy
    from zoo import from_pretrained
    from zoo.layers.lora import has_lora

    source = str(tmp_path / "pairs.jsonl")
    with open(source, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    batches = data.build_dataset(
        source,
        "all",
        make_tokenizer(dirs["policy"]),
        128,
        2 if mesh is None else mesh.size,  # rows: the pairs', then padding
        data_format="preference",
        chat_template=ChatTemplate.from_dir(dirs["policy"]),
        num_batches=1,
    )
    strategy = get_strategy("dp")
    mesh = mesh or strategy.make_mesh(devices=jax.devices()[:1])
    with jax.set_mesh(mesh):
        batch = {k: jnp.asarray(v) for k, v in next(iter(batches)).items()}
        if model is None:
            model = from_pretrained(dirs["policy"], strategy)
        reference = None
        if objective.needs_reference and not has_lora(model):
            reference = nnx.split(from_pretrained(dirs["reference"], strategy))
        model = nnx.view(model, deterministic=True, raise_if_not_found=False)

        @jax.jit
        def run(model, batch, reference):
            return preference.loss_sum(objective, model, batch, reference=reference)

        total, (count, sums) = run(model, batch, reference)
    assert int(count) == len(records)  # every pair read, each once
    # (An MoE model's sums also hold each expert's load, a vector: not TRL's.)
    scalars = {k: float(v / count) for k, v in sums.items() if jnp.ndim(v) == 0}
    return {"loss": float(total / count), **scalars}


def _ours_with(model, mesh, dirs, records, tmp_path, objective):
    """`_ours` for a model already loaded on `mesh` (a LoRA run's: its reference is the
    base)."""
    return _ours(dirs, records, tmp_path, objective, model=model, mesh=mesh)


DIFFERENCES = {
    "rewards/margins": ("rewards/chosen", "rewards/rejected"),
    "log_odds_chosen": ("logps/chosen", "logps/rejected"),
}


def _assert_close(ours, theirs, keys, what: str):
    # One line per metric (`pytest -s`): docs/preference.md's table of the differences.
    for key in keys:
        rel = abs(ours[key] - theirs[key]) / max(abs(theirs[key]), 1e-30)
        print(f"vs TRL | {what} | {key} | {theirs[key]:.6g} | {rel:.1e}")
    for key in keys:
        # A margin (of rewards, of log odds) is a difference: relative to its terms.
        terms = DIFFERENCES.get(key)
        atol = RTOL * sum(abs(theirs[t]) for t in terms) if terms else 1e-7
        np.testing.assert_allclose(ours[key], theirs[key], rtol=RTOL, atol=atol, err_msg=key)


TRL_METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins",
               "rewards/accuracies", "logps/chosen", "logps/rejected")  # fmt: skip


@pytest.mark.parametrize("kind", ["standard", "conversational"])
def test_dpo_equals_trl_dpo_trainer(dirs, tmp_path, kind):
    from nnx_zoo.training.preference import Objective

    records = PAIRS if kind == "standard" else CONVERSATIONAL
    theirs, _, _ = _trl_dpo(dirs, records, tmp_path)
    ours = _ours(dirs, records, tmp_path, Objective("dpo", dpo_beta=BETA))
    # Not a degenerate case: the reference differs from the policy.
    assert min(abs(theirs["rewards/chosen"]), abs(theirs["rewards/rejected"])) > 1e-3
    _assert_close(ours, theirs, TRL_METRICS, f"dpo ({kind})")


@pytest.fixture(scope="module")
def trl_logps(dirs, tmp_path_factory):
    """TRL's length-averaged answer logps (`get_batch_logps`), and ORPO's NLL of the chosen
    sequences, of the torch policy on TRL's DPO batch of PAIRS."""
    cpo = pytest.importorskip("trl.experimental.cpo", reason="trl has no CPOTrainer")
    theirs, batch, model = _trl_dpo(dirs, PAIRS, tmp_path_factory.mktemp("trl_logps"))
    with torch.no_grad():
        logits = _torch_model(dirs["policy"])(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
        ).logits
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    logps = cpo.CPOTrainer.get_batch_logps(logits, labels, average_log_prob=True)
    n = len(PAIRS)
    # ORPOTrainer.concatenated_forward: cross entropy over the chosen sequences' every token.
    full = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)[:n, 1:]
    nll = torch.nn.CrossEntropyLoss()(
        logits[:n, :-1].reshape(-1, logits.shape[-1]), full.reshape(-1)
    )
    return logps[:n], logps[n:], nll


def test_simpo_equals_trl_cpo_simpo(dirs, tmp_path, trl_logps):
    from nnx_zoo.training.preference import Objective

    cpo = pytest.importorskip("trl.experimental.cpo")
    chosen, rejected, _ = trl_logps
    beta, gamma = 2.0, 1.0
    trainer = types.SimpleNamespace(
        alpha=0.0, loss_type="simpo", beta=beta, simpo_gamma=gamma, label_smoothing=0.0,
        accelerator=types.SimpleNamespace(device="cpu"),
    )  # fmt: skip
    losses, reward_c, reward_r = cpo.CPOTrainer.cpo_loss(trainer, chosen, rejected)
    theirs = _reward_metrics(reward_c, reward_r, chosen, rejected, losses.mean())
    ours = _ours(dirs, PAIRS, tmp_path, Objective("simpo", simpo_beta=beta, simpo_gamma=gamma))
    _assert_close(ours, theirs, TRL_METRICS, "simpo")


def test_orpo_equals_trl_orpo(dirs, tmp_path, trl_logps):
    from nnx_zoo.training.preference import Objective

    orpo = pytest.importorskip("trl.experimental.orpo", reason="trl has no ORPOTrainer")
    chosen, rejected, nll = trl_logps
    trainer = types.SimpleNamespace(beta=BETA, accelerator=types.SimpleNamespace(device="cpu"))
    losses, reward_c, reward_r, ratio, log_odds = orpo.ORPOTrainer.odds_ratio_loss(
        trainer, chosen, rejected
    )
    # ORPOTrainer.get_batch_loss_metrics: loss = policy_nll_loss - losses.mean()
    theirs = _reward_metrics(reward_c, reward_r, chosen, rejected, nll - losses.mean())
    theirs.update(nll_loss=float(nll), log_odds_ratio=float(ratio), log_odds_chosen=float(log_odds))
    ours = _ours(dirs, PAIRS, tmp_path, Objective("orpo", orpo_beta=BETA))
    keys = (*TRL_METRICS, "nll_loss", "log_odds_ratio", "log_odds_chosen")
    _assert_close(ours, theirs, keys, "orpo")


def _reward_metrics(reward_c, reward_r, chosen, rejected, loss) -> dict:
    """The metrics CPOTrainer / ORPOTrainer log, from their loss functions' outputs."""
    return {
        "loss": float(loss),
        "rewards/chosen": float(reward_c.mean()),
        "rewards/rejected": float(reward_r.mean()),
        "rewards/margins": float((reward_c - reward_r).mean()),
        "rewards/accuracies": float((reward_c > reward_r).float().mean()),
        "logps/chosen": float(chosen.mean()),
        "logps/rejected": float(rejected.mean()),
    }


def test_moe_dpo_adds_the_router_loss_as_trl(tmp_path_factory, tmp_path):
    """A tiny Qwen3-MoE (router_aux_loss_coef 0.01): TRL's DPOTrainer adds coef x the
    policy forward's `aux_loss` to the loss and logs `aux_loss`; so does this project."""
    moe = _policy_and_reference(tmp_path_factory.mktemp("preference_moe"), "qwen3-moe-tiny")
    from nnx_zoo.training.preference import Objective

    theirs, _, model = _trl_dpo(moe, PAIRS, tmp_path)
    assert model.config.router_aux_loss_coef == 0.01 and "aux_loss" in theirs
    ours = _ours(moe, PAIRS, tmp_path, Objective("dpo", dpo_beta=BETA))
    # The aux loss is a real part of the loss: far above the tolerance.
    assert 0.01 * theirs["aux_loss"] > 1e-2 * theirs["loss"]
    _assert_close(ours, theirs, (*TRL_METRICS, "aux_loss"), "dpo (Qwen3-MoE)")


def test_lora_dpo_peft_export_equals_trl(dirs, tmp_path):
    """A LoRA-DPO run (train_main from the HF directory), exported as a PEFT adapter and
    loaded by TRL with the base as its reference: TRL's loss and metrics on a batch are this
    project's, whose reference is the same base with the adapters zeroed (goal 2)."""
    import _entry
    import datasets
    import peft
    import transformers
    from _train_helpers import run_train_main

    from nnx_zoo.evaluation.model import LoadRequest, load
    from nnx_zoo.training.preference import Objective

    source = str(tmp_path / "pairs.jsonl")
    with open(source, "w") as f:
        f.writelines(json.dumps(CONVERSATIONAL[i % 4]) + "\n" for i in range(16))
    workdir, adapter = str(tmp_path / "run"), str(tmp_path / "peft")
    flags = {
        "data.source": source, "data.format": "preference", "training.objective": "dpo",
        "data.seq_len": 128, "data.global_batch_size": 8, "data.validation_fraction": 0.25,
        "training.steps": 3, "training.eval_batches": 1, "optimizer.warmup_steps": 0,
        "optimizer.learning_rate": 1e-2, "lora.rank": 8, "lora.alpha": 16,
        "logging.progress_bar": False, "checkpoint.every": 3,
    }  # fmt: skip
    result = run_train_main(
        [f"--init_from={dirs['policy']}", f"--workdir={workdir}", "--sharding_strategy=dp"]
        + [f"--config.{k}={v}" for k, v in flags.items()]
    )
    assert result.returncode == 0, result.stderr[-3000:]
    result = _entry.run_main(
        "export_main", [f"--workdir={workdir}", "--format=peft", f"--out={adapter}"]
    )
    assert result.returncode == 0, result.stderr[-3000:]

    base = _torch_model(dirs["policy"])
    args = trl.DPOConfig(
        output_dir=str(tmp_path / "trl"), beta=BETA, max_length=None,
        per_device_train_batch_size=len(CONVERSATIONAL), use_cpu=True, bf16=False,
        report_to="none", save_strategy="no",
    )  # fmt: skip
    trainer = trl.DPOTrainer(
        model=peft.PeftModel.from_pretrained(base, adapter, is_trainable=True),
        ref_model=_torch_model(dirs["policy"]),  # the base: the run's reference
        args=args,
        train_dataset=datasets.Dataset.from_list(CONVERSATIONAL),
        processing_class=transformers.AutoTokenizer.from_pretrained(dirs["policy"]),
    )
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(CONVERSATIONAL))])
    trainer.model.eval()  # no LoRA dropout
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch)
    theirs = {"loss": float(loss), **{k: v[-1] for k, v in trainer._metrics["eval"].items()}}

    *_, model, mesh, _ = load(LoadRequest(workdir, overrides={"strategy": "dp"}))
    ours = _ours_with(model, mesh, dirs, CONVERSATIONAL, tmp_path, Objective("dpo", dpo_beta=BETA))
    assert theirs["rewards/margins"] > 0.1  # the adapters moved away from the base
    _assert_close(ours, theirs, TRL_METRICS, "dpo (LoRA, PEFT export)")
