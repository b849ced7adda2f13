"""Small local tokenizer directories with the published chat templates of Llama 3, Qwen3 and
Gemma 3 (tests/chat_templates/), and tiny Hugging Face checkpoints to fine-tune: no hub."""

from __future__ import annotations

import json
import os

TEMPLATE_DIR = os.path.join(os.path.dirname(__file__), "chat_templates")
# family -> (bos, eos, the special tokens its template writes)
FAMILIES = {
    "llama3": (
        "<|begin_of_text|>",
        "<|eot_id|>",
        ["<|start_header_id|>", "<|end_header_id|>", "<|end_of_text|>"],
    ),
    "qwen3": (None, "<|im_end|>", ["<|im_start|>", "<|endoftext|>", "<think>", "</think>"]),
    "gemma3": ("<bos>", "<eos>", ["<start_of_turn>", "<end_of_turn>", "<start_of_image>"]),
}
CORPUS = [
    "You are a helpful assistant. What is the capital of France? Paris is the capital.",
    "user assistant system model Hello there! How are you doing today? I am fine, thanks.",
    "Write a poem about the sea. The sea is wide and deep and blue. 0123456789 + - * / = ?",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
]


def chat_template(family: str) -> str:
    with open(os.path.join(TEMPLATE_DIR, f"{family}.jinja"), encoding="utf-8") as f:
        return f.read()


def write_tokenizer_dir(path: str, family: str, vocab_size: int = 384) -> str:
    """tokenizer.json (a byte-level BPE trained on CORPUS, plus the family's special tokens)
    and tokenizer_config.json with the family's chat template, bos and eos."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bos, eos, extra = FAMILIES[family]
    specials = [t for t in (bos, eos) if t] + extra
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    tok.add_special_tokens(specials)
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": chat_template(family),
        "eos_token": eos,
        "model_max_length": 4096,
    }
    if bos:
        config["bos_token"] = bos
    with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    return path


def chats(with_system: bool) -> list[list[dict]]:
    """Multi-turn chats (Gemma's template wants user/assistant alternation)."""
    system = [{"role": "system", "content": "You are a helpful assistant."}]
    turns = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris is the capital."},
        {"role": "user", "content": "Write a poem about the sea."},
        {"role": "assistant", "content": "The sea is wide\nand deep and blue."},
    ]
    return [(system if with_system else []) + turns, (system if with_system else []) + turns[:1]]


def write_chats_jsonl(path: str, n: int = 24, seed: int = 0) -> str:
    """`n` varied chats as JSONL records with `messages`."""
    import random

    rng = random.Random(seed)
    words = ["the", "sea", "is", "wide", "deep", "blue", "Paris", "capital", "poem"]
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            messages = [{"role": "system", "content": "You are a helpful assistant."}] * (i % 2)
            for _ in range(1 + i % 3):
                messages.append({"role": "user", "content": " ".join(rng.choices(words, k=6))})
                messages.append(
                    {"role": "assistant", "content": " ".join(rng.choices(words, k=1 + i % 7))}
                )
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def write_tiny_checkpoint(path: str, family: str = "llama3", preset: str = "tiny", **overrides):
    """A tiny random model of `preset` saved with zoo.save_pretrained, beside the family's
    tokenizer files: a local stand-in for a hub checkpoint."""
    import jax
    from flax import nnx

    from shardings import get_strategy
    from zoo import create_model, get_config, save_pretrained

    strategy = get_strategy("dp")
    mesh = strategy.make_mesh(devices=jax.devices()[:1])
    with jax.set_mesh(mesh):
        cfg = get_config(preset, vocab_size=384, **overrides)
        model = create_model(cfg, strategy, rngs=nnx.Rngs(0))
        save_pretrained(model, path)
    write_tokenizer_dir(path, family)
    return path
