"""One registry of model families: every family folder registers its config, model, presets
and Hugging Face format, and the zoo's lookups (presets, model class, HF architecture) read it."""

from __future__ import annotations

import dataclasses

import pytest

from zoo import get_config
from zoo.build import model_class
from zoo.hf_mapping import family_for_hf
from zoo.llama.modeling import LlamaConfig
from zoo.registry import FAMILIES, Family, preset_table, register


def test_every_family_is_registered_with_its_parts():
    assert {"llama", "qwen3", "mistral", "gemma3", "gpt2"} <= set(FAMILIES)
    for name, fam in FAMILIES.items():
        assert fam.presets, name
        for preset in fam.presets:
            cfg = get_config(preset)
            assert type(cfg) is fam.config_cls and model_class(cfg) is fam.model_cls, preset
        arch = fam.hf.architectures[0]
        assert family_for_hf({"architectures": [arch]}, "config.json") is fam


def test_a_preset_name_taken_by_another_family_is_refused():
    llama = FAMILIES["llama"]
    clash = dataclasses.replace(llama, name="llama_copy", presets={"tiny": llama.presets["tiny"]})
    with pytest.raises(ValueError, match=r"preset 'tiny' of 'llama_copy' is 'llama''s"):
        register(clash)
    assert "llama_copy" not in FAMILIES


def test_a_family_registered_twice_is_refused():
    with pytest.raises(ValueError, match=r"model family 'gpt2' is registered twice"):
        register(Family(name="gpt2", config_cls=object, model_cls=object, presets={}))


def test_unknown_preset_lists_the_registered_ones():
    with pytest.raises(ValueError, match=r"unknown model preset 'llama9'; valid presets: .*tiny"):
        get_config("llama9")


def test_a_preset_table_row_is_the_dims_then_the_other_fields():
    table = preset_table(
        LlamaConfig, {"t": (512, 64, 2, 8, 4, 16, 128, 256, {"tie_embeddings": True})}
    )
    cfg = table["t"](num_layers=3)  # an override wins over the row
    assert (cfg.vocab_size, cfg.hidden_dim, cfg.num_layers, cfg.max_seq_len) == (512, 64, 3, 256)
    assert cfg.tie_embeddings and type(cfg) is LlamaConfig
    with pytest.raises(ValueError, match=r"preset 'short' has 7 dims; a row holds vocab_size, "):
        preset_table(LlamaConfig, {"short": (512, 64, 2, 8, 4, 16, 128)})
