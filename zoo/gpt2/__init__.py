"""GPT-2."""

from zoo.gpt2.modeling import GPT2, GPT2Config

__all__ = ["GPT2", "GPT2Config"]
