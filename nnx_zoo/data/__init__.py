"""Text in, packed [B, T] token batches out: sources (the `source` string and its train /
validation split), tokenizers, and the Grain pipeline that packs documents into rows.

Used by training, evaluation and the benches alike; imports nothing from them.
"""

from nnx_zoo.data.mixture import build_mixture, make_mixture
from nnx_zoo.data.pipeline import build_dataset, make_dataset
from nnx_zoo.data.sources import NoValidationSplitError
from nnx_zoo.data.text_source import DataFileError

__all__ = [
    "DataFileError",
    "NoValidationSplitError",
    "build_dataset",
    "build_mixture",
    "make_dataset",
    "make_mixture",
]
