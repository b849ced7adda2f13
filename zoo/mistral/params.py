"""Mistral checkpoints <-> ours: Llama's names and config, plus the sliding window."""

from __future__ import annotations

from zoo.hf_mapping import HfFormat
from zoo.llama.params import decoder_config_from_hf, decoder_config_to_hf, decoder_rules

HF_FORMAT = HfFormat(
    architectures=("MistralForCausalLM",),
    model_types=("mistral",),
    # transformers 5 masks `q - W < kv <= q`: W keys incl. the query, our convention too.
    config_from_hf=lambda hf: {
        **decoder_config_from_hf(hf, tie_default=False),
        "sliding_window": hf.get("sliding_window"),
    },
    config_to_hf=lambda cfg: {
        **decoder_config_to_hf(cfg, "MistralForCausalLM", "mistral"),
        "sliding_window": cfg.sliding_window,
    },
    rules=decoder_rules,
    ignored=(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",),
)
