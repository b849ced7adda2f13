"""Fixtures the benches and the tests share (the benches import no test module): the small
run shapes, packed rows' segment ids and positions, a small BPE tokenizer trained on the
example tasks' text, and a tiny random Llama saved as a Hugging Face directory with it."""

from __future__ import annotations

import json
import os

import numpy as np

# A model and batch small enough for a run in seconds on CPU (the tests' SMALL_RUN adds the
# optimizer to it).
SMALL_SHAPES = {
    "model.hidden_dim": 64,
    "model.num_layers": 2,
    "model.head_dim": 8,
    "model.ffn_dim": 128,
    "data.seq_len": 64,
    "data.global_batch_size": 16,
}
# What a short measured run logs: metrics.jsonl each step, nothing it would not read; with
# no evaluation, warmup or checkpoint to time beside the steps.
QUIET_LOGS = {
    "logging.log_every": 1,
    "logging.progress_bar": False,
    "logging.tensorboard": False,
    "logging.loss_curve": False,
}
STEPS_ONLY = {
    "training.eval_every": 0,
    "training.eval_batches": 1,
    "optimizer.warmup_steps": 0,
    "checkpoint.enabled": False,
    **QUIET_LOGS,
}


def config_flags(overrides: dict) -> list[str]:
    return [f"--config.{k}={v}" for k, v in overrides.items()]


def packed_rows(doc_lengths_per_row, T):
    """segment ids (1-based, 0 = padding) and positions (restart per document) for rows."""
    seg = np.zeros((len(doc_lengths_per_row), T), np.int32)
    pos = np.zeros_like(seg)
    for b, lengths in enumerate(doc_lengths_per_row):
        start = 0
        for i, n in enumerate(lengths):
            seg[b, start : start + n] = i + 1
            pos[b, start : start + n] = np.arange(n)
            start += n
        assert start <= T
    return seg, pos


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The example tasks (package data).
TASKS = os.path.join(ROOT, "nnx_zoo", "evaluation", "lm_eval_tasks")
# Scales the random LM head so next-token distributions are peaked (see write_tiny_llama).
HEAD_SCALE = 8.0

# Two BOS/EOS conventions the harness's hf backend treats differently:
#   llama: the tokenizer adds BOS ("<s>") itself, and BOS is the prefix token;
#   gpt2:  no BOS: nothing is added, and EOS ("<|endoftext|>") is the prefix token.
STYLES = {
    "llama": dict(specials=["<s>", "</s>"], bos="<s>", eos="</s>"),
    "gpt2": dict(specials=["<|endoftext|>"], bos=None, eos="<|endoftext|>"),
}


def _task_text() -> list[str]:
    lines = []
    for name in ("zoo_facts.jsonl", "zoo_prose.jsonl"):
        with open(os.path.join(TASKS, name), encoding="utf-8") as f:
            for line in f:
                row = json.loads(line)
                lines.append(row.get("text") or " ".join([row["question"], *row["choices"]]))
    return lines


def write_tokenizer(directory: str, style: str, vocab_size: int = 400) -> None:
    """tokenizer.json + tokenizer_config.json in `directory` (byte-level BPE)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    spec = STYLES[style]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=spec["specials"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_task_text(), trainer)
    if spec["bos"]:
        bos = spec["bos"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, 0)]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": spec["eos"]}
    if spec["bos"]:
        config["bos_token"] = spec["bos"]
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)


def write_tiny_llama(
    directory: str, style: str, *, max_seq_len: int = 64, seed: int = 0, preset: str = "tiny"
):
    """A tiny random Llama (vocab 512) saved with zoo.save_pretrained, plus a tokenizer
    (`preset`: another tiny zoo preset of vocab 512, e.g. qwen3-moe-tiny).

    The LM head is scaled up (HEAD_SCALE) so that next-token distributions are peaked: greedy
    choices then have margins far above float32 noise, and torch and XLA pick the same tokens.
    """
    import jax
    import numpy as np
    from flax import nnx
    from jax.sharding import NamedSharding

    import zoo
    from shardings import get_strategy
    from zoo.build import model_class

    strategy = get_strategy("dp")
    mesh = strategy.make_mesh(devices=jax.devices()[:1])
    cfg = zoo.get_config(preset, max_seq_len=max_seq_len)
    # Filled from numpy (norms 1, the rest N(0, 0.02)): compiling the model's own random
    # initialiser costs tens of seconds on a loaded 2-core host.
    rng = np.random.default_rng(seed)
    with jax.set_mesh(mesh):
        model = nnx.eval_shape(
            lambda: model_class(cfg)(cfg, strategy.lm_sharding(), rngs=nnx.Rngs(0))
        )
        for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
            shape, spec = var.value.shape, var.value.sharding.spec
            if "norm" in path[-2]:
                value = np.ones(shape, np.float32)
            else:
                value = rng.normal(0.0, 0.02, shape).astype(np.float32)
            if path[0] == "lm_head":
                value *= HEAD_SCALE
            var.set_value(jax.device_put(value, NamedSharding(mesh, spec)))
    zoo.save_pretrained(model, directory)
    write_tokenizer(directory, style)
    # As a real checkpoint's config names them: transformers' generation stops at this EOS
    # (without it, LlamaConfig's default id 2).
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(directory, "tokenizer.json"))
    spec = STYLES[style]
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["eos_token_id"] = tok.token_to_id(spec["eos"])
    config["bos_token_id"] = tok.token_to_id(spec["bos"] or spec["eos"])
    with open(path, "w") as f:
        json.dump(config, f, indent=2)
