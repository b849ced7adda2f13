"""Loads the example tasks' JSONL files from this directory, wherever the harness runs from.

lm-eval calls a task's `custom_dataset` with the task's metadata and `dataset_kwargs`; the
file named by `dataset_kwargs: {file: ...}` is read from beside this module, so the tasks
need no dataset hub and no absolute paths.
"""

import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def load(file, **_metadata):
    # Here, not at the top: `datasets` comes with the [eval] extra, and the package's modules
    # all import without it.
    import datasets

    with open(os.path.join(HERE, file), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
