"""Mistral."""

from zoo.mistral.modeling import Mistral, MistralConfig

__all__ = ["Mistral", "MistralConfig"]
