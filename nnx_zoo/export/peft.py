"""A model's LoRA adapters in PEFT's format: `adapter_model.safetensors` + `adapter_config.json`.

PEFT names an adapter after the module it wraps in the transformers model, under
`base_model.model.`: `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` [r, in]
and `...lora_B.weight` [out, r] (torch's Linear layout, [out, in]). Ours are A [in dims..., r]
and B [r, out dims...] (zoo/layers/lora.py), so lora_A = A flattened to [in, r], transposed,
and lora_B = B flattened to [r, out], transposed. The module names come from the family's own
Hugging Face mapping (the rule that holds the base weight), so every family that maps q/k/v/o
and the MLP projections exports its adapters.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np

from nnx_zoo.errors import UsageError
from zoo.hf_io import _to_host
from zoo.hf_mapping import hf_format
from zoo.layers.lora import adapters

ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
_WEIGHT_SUFFIX = ".weight"


def _module_names(cfg) -> dict[str, str]:
    """Our stacked weight key ('blocks/attention/q/weight') -> the HF module name pattern
    ('model.layers.{i}.self_attn.q_proj')."""
    names = {}
    for r in hf_format(cfg).rules(cfg):
        if len(r.ours) == 1 and r.per_layer and r.hf.endswith(_WEIGHT_SUFFIX):
            names[r.ours[0]] = r.hf[: -len(_WEIGHT_SUFFIX)]
    return names


def adapter_tensors(model) -> tuple[dict[str, np.ndarray], list[str]]:
    """({PEFT tensor name: array}, the HF module names adapted, e.g. ['q_proj', 'v_proj'])."""
    cfg = model.cfg
    names = _module_names(cfg)
    tensors, modules = {}, set()
    for path, module in adapters(model):
        parts = [str(p) for p in path if not isinstance(p, int)]
        layer = next((p for p in path if isinstance(p, int)), None)
        key = "/".join([*parts, "weight"])
        if key not in names:
            raise UsageError(f"{key}: no Hugging Face module of {type(cfg).__name__} holds it")
        a, b = _to_host(module.lora.a[...]), _to_host(module.lora.b[...])
        a_dims = module.lora.eq_a.split(",")[1].split("->")[0]  # in dims + r
        stacked = a.ndim > len(a_dims)  # scanned blocks: a leading L
        layers = range(a.shape[0]) if stacked else [layer]
        for i in layers:
            a_i, b_i = (a[i], b[i]) if stacked else (a, b)
            rank = a_i.shape[-1]
            base = "base_model.model." + names[key].format(i=i)
            tensors[f"{base}.lora_A.weight"] = np.ascontiguousarray(
                a_i.reshape(math.prod(a_i.shape[:-1]), rank).T.astype(np.float32)
            )
            tensors[f"{base}.lora_B.weight"] = np.ascontiguousarray(
                b_i.reshape(rank, -1).T.astype(np.float32)
            )
        modules.add(names[key].rsplit(".", 1)[-1])
    return tensors, sorted(modules)


def save_peft(model, path: str, *, lora_section, base_model: str | None) -> None:
    """Write `model`'s adapters as a PEFT adapter directory at `path` (process 0 writes)."""
    import jax
    from safetensors.numpy import save_file

    if not adapters(model):
        raise UsageError("--format=peft: this run has no LoRA adapters (lora.rank unset)")
    tensors, modules = adapter_tensors(model)
    if jax.process_index() != 0:
        return
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, ADAPTER_FILE), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora_section.rank,
        "lora_alpha": lora_section.alpha,
        "lora_dropout": lora_section.dropout,
        "target_modules": modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    with open(os.path.join(path, ADAPTER_CONFIG), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
