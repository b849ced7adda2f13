"""Export a trained run: rebuild its model from the checkpoint (the base from `init_from` plus
the adapters, for a LoRA run) and write it as a Hugging Face checkpoint or a PEFT adapter."""

from __future__ import annotations

import os

FORMATS = ("hf", "peft")


def export_run(workdir: str, out: str, fmt: str, step: int | None = None) -> int:
    """Write checkpoint `step` (default: the latest) of the run in `workdir` to `out` as
    `fmt`: 'hf' (merged weights through zoo.save_pretrained, for any run, plus the run's
    tokenizer files when it has them) or 'peft' (the LoRA adapters). Returns the step."""
    import jax

    from nnx_zoo.checkpoint.restore import read_meta
    from nnx_zoo.evaluation import model as eval_model
    from nnx_zoo.evaluation.settings import from_run_info, run_config

    if fmt not in FORMATS:
        raise ValueError(f"unknown --format={fmt!r}; valid: {', '.join(FORMATS)}")
    if not os.path.isdir(workdir):
        raise FileNotFoundError(
            f"--workdir={workdir} is not a directory; it names a train_main run (its checkpoints/)"
        )
    step, meta = read_meta(workdir, step)
    run_info = meta.get("run_info") or {}
    run = run_config(run_info)
    if fmt == "peft" and not run.lora.enabled:
        raise ValueError(
            "--format=peft exports LoRA adapters, and this run has none (lora.rank unset); "
            "use --format=hf"
        )
    settings = from_run_info(run_info)
    model, mesh, step = eval_model.load_from_checkpoint(workdir, run_info, settings, step)
    with jax.set_mesh(mesh):
        if fmt == "peft":
            from nnx_zoo.export.peft import save_peft

            save_peft(model, out, lora_section=run.lora, base_model=run_info.get("init_from"))
        else:
            from zoo import save_pretrained
            from zoo.layers.lora import merge_lora

            merge_lora(model)
            save_pretrained(model, out)
            _copy_tokenizer(settings.tokenizer, out)
    return step


_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tokenizer.model",
)


def _copy_tokenizer(spec: str, out: str) -> None:
    """The run's tokenizer files beside the weights, so the export loads on its own."""
    import shutil

    import jax

    if spec == "byte" or jax.process_index() != 0:
        return
    path = os.path.expanduser(spec)
    directory = path if os.path.isdir(path) else os.path.dirname(path)
    for name in _TOKENIZER_FILES:
        src = os.path.join(directory, name)
        if os.path.exists(src):
            shutil.copy(src, os.path.join(out, name))
