"""GPT-2. The family registers itself: config, model, presets, Hugging Face format."""

from zoo.gpt2.modeling import GPT2, PRESETS, GPT2Config
from zoo.gpt2.params import HF_FORMAT
from zoo.registry import Family, register

FAMILY = register(
    Family(name="gpt2", config_cls=GPT2Config, model_cls=GPT2, presets=PRESETS, hf=HF_FORMAT)
)

__all__ = ["FAMILY", "GPT2", "GPT2Config"]
