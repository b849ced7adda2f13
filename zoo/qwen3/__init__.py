"""Qwen3 (dense). The family registers itself: config, model, presets, Hugging Face format."""

from zoo.qwen3.modeling import PRESETS, Qwen3, Qwen3Config
from zoo.qwen3.params import HF_FORMAT
from zoo.registry import Family, register

FAMILY = register(
    Family(name="qwen3", config_cls=Qwen3Config, model_cls=Qwen3, presets=PRESETS, hf=HF_FORMAT)
)

__all__ = ["FAMILY", "Qwen3", "Qwen3Config"]
