"""DeepSeek-V3. The family registers itself: config, model, presets, Hugging Face format."""

from zoo.deepseek_v3.modeling import PRESETS, DeepseekV3, DeepseekV3Config
from zoo.deepseek_v3.params import HF_FORMAT
from zoo.registry import Family, register

FAMILY = register(
    Family(
        name="deepseek_v3",
        config_cls=DeepseekV3Config,
        model_cls=DeepseekV3,
        presets=PRESETS,
        hf=HF_FORMAT,
    )
)

__all__ = ["FAMILY", "DeepseekV3", "DeepseekV3Config"]
