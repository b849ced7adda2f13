"""The model zoo: families built from zoo/layers/, sharded by the strategies in shardings/."""

from zoo.build import check_model_fits, create_model, get_config, param_layouts
from zoo.hf_io import from_pretrained, save_pretrained
from zoo.layers.config import DecoderConfig

__all__ = [
    "DecoderConfig",
    "check_model_fits",
    "create_model",
    "from_pretrained",
    "get_config",
    "param_layouts",
    "save_pretrained",
]
