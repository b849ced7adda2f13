"""A trained run out to Hugging Face formats: a merged checkpoint (`hf`, any run) or a LoRA
adapter in PEFT's format (`peft`). `export_main.py` is the command."""

from nnx_zoo.export.run import FORMATS, export_run

__all__ = ["FORMATS", "export_run"]
