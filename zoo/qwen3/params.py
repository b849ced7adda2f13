"""Qwen3 checkpoints <-> ours: Llama's names plus q_norm / k_norm."""

from __future__ import annotations

from zoo.hf_mapping import HfFormat
from zoo.layers.config import FULL, SLIDING
from zoo.llama.params import decoder_config_from_hf, decoder_config_to_hf, decoder_rules
from zoo.qwen3.modeling import Qwen3Config


def config_from_hf(hf: dict) -> dict:
    fields = decoder_config_from_hf(hf, tie_default=False)
    if hf.get("use_sliding_window") and hf.get("sliding_window"):
        # transformers 4.x derived the sliding layers from max_window_layers; 5 lists them.
        L, first = hf["num_hidden_layers"], hf.get("max_window_layers", 28)
        types = hf.get("layer_types") or [SLIDING if i >= first else FULL for i in range(L)]
        fields.update(sliding_window=hf["sliding_window"], layer_types=tuple(types))
    return fields


def config_to_hf(cfg: Qwen3Config) -> dict:
    windows = cfg.layer_windows()
    return {
        **decoder_config_to_hf(cfg, "Qwen3ForCausalLM", "qwen3"),
        "use_sliding_window": any(windows),
        "sliding_window": cfg.sliding_window if any(windows) else None,
        "layer_types": [SLIDING if w else FULL for w in windows],
    }


HF_FORMAT = HfFormat(
    architectures=("Qwen3ForCausalLM",),
    model_types=("qwen3",),
    config_from_hf=config_from_hf,
    config_to_hf=config_to_hf,
    rules=decoder_rules,
    ignored=(r"lm_head\.weight",),  # a tied checkpoint may still store the head
)
