"""Gemma 3 (text). The family registers itself: config, model, presets, Hugging Face format."""

from zoo.gemma3.modeling import PRESETS, Gemma3, Gemma3Config
from zoo.gemma3.params import HF_FORMAT
from zoo.registry import Family, register

FAMILY = register(
    Family(name="gemma3", config_cls=Gemma3Config, model_cls=Gemma3, presets=PRESETS, hf=HF_FORMAT)
)

__all__ = ["FAMILY", "Gemma3", "Gemma3Config"]
