"""Llama 3.x. The family registers itself: config, model, presets, Hugging Face format."""

from zoo.llama.modeling import PRESETS, Llama, LlamaConfig
from zoo.llama.params import HF_FORMAT
from zoo.registry import Family, register

FAMILY = register(
    Family(name="llama", config_cls=LlamaConfig, model_cls=Llama, presets=PRESETS, hf=HF_FORMAT)
)

__all__ = ["FAMILY", "Llama", "LlamaConfig"]
