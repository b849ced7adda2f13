"""The model zoo: families built from zoo/layers/, sharded by the strategies in shardings/."""

from zoo.build import check_model_fits, create_model, get_config, param_layouts
from zoo.layers.config import DecoderConfig

__all__ = ["DecoderConfig", "check_model_fits", "create_model", "get_config", "param_layouts"]
