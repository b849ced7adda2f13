"""Qwen3-MoE. The family registers itself: config, model, presets, Hugging Face format."""

from zoo.qwen3_moe.modeling import PRESETS, Qwen3Moe, Qwen3MoeConfig
from zoo.qwen3_moe.params import HF_FORMAT
from zoo.registry import Family, register

FAMILY = register(
    Family(
        name="qwen3_moe",
        config_cls=Qwen3MoeConfig,
        model_cls=Qwen3Moe,
        presets=PRESETS,
        hf=HF_FORMAT,
    )
)

__all__ = ["FAMILY", "Qwen3Moe", "Qwen3MoeConfig"]
