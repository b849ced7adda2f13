"""`--override section.field=value` for the benches that build a run from a shipped config."""

from __future__ import annotations


def apply_overrides(config, overrides) -> None:
    """Set each `section.field=value` on the ml_collections `config`, the value parsed as the
    field's current type (so `model.remat=none`, `optimizer.micro_batches=2`)."""
    for override in overrides or []:
        path, value = override.split("=", 1)
        section, field = path.split(".")
        setattr(config[section], field, type(config[section][field])(value))
