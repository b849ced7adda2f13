"""Run configs: one `get_config()` per file, each starting from `base_config()` below.

Every field, its default and its comment live once, in nnx_zoo/training/config.py's dataclasses; the
files here change values and say why. `train_main.py` loads a file with
`--config=configs/<name>.py` (or `--config=<name>`), applies `--config.<section>.<field>=value`
overrides (a misspelt field is an error: the ConfigDict is locked), then converts it to the
typed `training.config.RunConfig`, which validates every value.
"""

from ml_collections import ConfigDict
from ml_collections.config_dict import placeholder

_PLACEHOLDER_TYPES = {"int": int, "float": float, "str": str, "bool": bool}


def base_config() -> ConfigDict:
    """Defaults shared by every run, from training.config; unlocked so a config file can
    change them. A field whose default is None is a typed placeholder, so an override still
    gets its type checked."""
    from nnx_zoo.training.config import defaults

    c = ConfigDict()
    c.name = "run"  # names the default workdir, ./runs/<name>
    for section, fields in defaults().items():
        c[section] = ConfigDict()
        for name, (default, kind) in fields.items():
            if default is None:
                default = placeholder(_PLACEHOLDER_TYPES[kind.removesuffix("|None")])
            c[section][name] = default
    return c
