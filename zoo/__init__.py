"""The model zoo: families built from zoo/layers/, sharded by the strategies in shardings/."""

# Each family package registers itself on import (zoo/registry.py); this is the one list.
from zoo import (  # noqa: F401
    deepseek_v3,
    gemma3,
    gpt2,
    gpt_oss,
    llama,
    mistral,
    mixtral,
    pipelined,  # noqa: F401 -- registers the plain call's pipeline runner
    qwen3,
    qwen3_moe,
)
from zoo.build import abstract_model, create_model, get_config
from zoo.hf_io import from_pretrained, save_pretrained
from zoo.layers.config import DecoderConfig
from zoo.layers.decoder import VOCAB_DIMS
from zoo.plan import ModelPlan, check_model_fits, param_layouts, plan_model

__all__ = [
    "VOCAB_DIMS",
    "DecoderConfig",
    "ModelPlan",
    "abstract_model",
    "check_model_fits",
    "create_model",
    "from_pretrained",
    "get_config",
    "param_layouts",
    "plan_model",
    "save_pretrained",
]
