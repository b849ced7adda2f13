"""Gemma 3 (text)."""

from zoo.gemma3.modeling import Gemma3, Gemma3Config

__all__ = ["Gemma3", "Gemma3Config"]
