"""A shipped config for a bench: by name, its batch and length set, `--override`s applied."""

from __future__ import annotations


def apply_overrides(config, overrides) -> None:
    """Set each `section.field=value` on the ml_collections `config`, the value parsed as the
    field's current type (so `model.remat=none`, `optimizer.micro_batches=2`)."""
    for override in overrides or []:
        path, value = override.split("=", 1)
        section, field = path.split(".")
        setattr(config[section], field, type(config[section][field])(value))


def shipped_config(name: str, *, batch: int = 0, seq: int = 0):
    """configs/NAME.py's config, unlocked, with the global batch / sequence length where
    given (0: the config's); the caller applies its --overrides last."""
    module = __import__(f"configs.{name}", fromlist=["get_config"])
    config = module.get_config()
    config.unlock()
    if batch:
        config.data.global_batch_size = batch
    if seq:
        config.data.seq_len = seq
    return config
