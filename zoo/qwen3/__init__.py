"""Qwen3 (dense)."""

from zoo.qwen3.modeling import Qwen3, Qwen3Config

__all__ = ["Qwen3", "Qwen3Config"]
