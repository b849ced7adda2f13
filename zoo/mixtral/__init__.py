"""Mixtral: Mistral with a mixture of experts in place of every MLP."""

from zoo.mixtral.modeling import Mixtral, MixtralConfig

__all__ = ["Mixtral", "MixtralConfig"]
