"""GPT-OSS. The family registers itself: config, model, presets, Hugging Face format."""

from zoo.gpt_oss.modeling import PRESETS, GptOss, GptOssConfig
from zoo.gpt_oss.params import HF_FORMAT
from zoo.registry import Family, register

FAMILY = register(
    Family(name="gpt_oss", config_cls=GptOssConfig, model_cls=GptOss, presets=PRESETS, hf=HF_FORMAT)
)

__all__ = ["FAMILY", "GptOss", "GptOssConfig"]
