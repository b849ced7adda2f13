"""Mistral. The family registers itself: config, model, presets, Hugging Face format."""

from zoo.mistral.modeling import PRESETS, Mistral, MistralConfig
from zoo.mistral.params import HF_FORMAT
from zoo.registry import Family, register

FAMILY = register(
    Family(
        name="mistral", config_cls=MistralConfig, model_cls=Mistral, presets=PRESETS, hf=HF_FORMAT
    )
)

__all__ = ["FAMILY", "Mistral", "MistralConfig"]
