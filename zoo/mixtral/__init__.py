"""Mixtral. The family registers itself: config, model, presets, Hugging Face format."""

from zoo.mixtral.modeling import PRESETS, Mixtral, MixtralConfig
from zoo.mixtral.params import HF_FORMAT
from zoo.registry import Family, register

FAMILY = register(
    Family(
        name="mixtral", config_cls=MixtralConfig, model_cls=Mixtral, presets=PRESETS, hf=HF_FORMAT
    )
)

__all__ = ["FAMILY", "Mixtral", "MixtralConfig"]
