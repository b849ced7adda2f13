"""Export a trained run: rebuild its model from the checkpoint (the base from `init_from` plus
the adapters, for a LoRA run) and write it as a Hugging Face checkpoint or a PEFT adapter."""

from __future__ import annotations

import os

from nnx_zoo.errors import UsageError

FORMATS = ("hf", "peft")


COMMAND = "export_main"


def export_run(
    workdir: str, out: str, fmt: str, step: int | None = None, *, overwrite: bool = False
) -> int:
    """Write checkpoint `step` (default: the latest) of the run in `workdir` to `out` as
    `fmt`: 'hf' (merged weights through zoo.save_pretrained, for any run, plus the run's
    tokenizer files: the byte tokenizer as a tokenizer.json) or 'peft' (the LoRA adapters).
    Returns the step.

    `out` is checked first (nnx_zoo/checkpoint/outputs.py): a file, a run's directory (or its
    checkpoints/, ...), or a directory holding anything is refused (UsageError), except, with
    `overwrite`, an earlier export's; the export is written beside `out` and renamed into
    place whole, with a manifest of what it wrote."""
    import jax

    from nnx_zoo.checkpoint import outputs
    from nnx_zoo.checkpoint.restore import read_meta
    from nnx_zoo.evaluation import model as eval_model
    from nnx_zoo.evaluation.settings import from_run_info, run_config

    if fmt not in FORMATS:
        raise UsageError(f"unknown --format={fmt!r}; valid: {', '.join(FORMATS)}")
    from nnx_zoo.runtime import storage

    if not storage.is_url(workdir) and not os.path.isdir(workdir):
        raise UsageError(
            f"--workdir={workdir} is not a directory; it names a train_main run (its checkpoints/)"
        )
    outputs.check_out_everywhere(out, COMMAND, overwrite=overwrite)
    step, meta = read_meta(workdir, step)
    run_info = meta.get("run_info") or {}
    run = run_config(run_info)
    if fmt == "peft" and not run.lora.enabled:
        raise UsageError(
            "--format=peft exports LoRA adapters, and this run has none (lora.rank unset); "
            "use --format=hf"
        )
    settings = from_run_info(run_info)
    model, mesh, step = eval_model.load_from_checkpoint(workdir, run_info, settings, step)
    writer = jax.process_index() == 0
    staging = outputs.staging_dir(out, clear=writer)
    with jax.set_mesh(mesh):
        if fmt == "peft":
            from nnx_zoo.export.peft import save_peft

            save_peft(model, staging, lora_section=run.lora, base_model=run_info.get("init_from"))
        else:
            from zoo import save_pretrained
            from zoo.layers.lora import merge_lora

            merge_lora(model)
            save_pretrained(model, staging)
            if writer:
                _write_tokenizer(settings.tokenizer, staging)
    if writer:
        outputs.publish(staging, out, COMMAND, format=fmt, workdir=workdir, step=step)
    return step


_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tokenizer.model",
)


def _write_tokenizer(spec: str, out: str) -> None:
    """The run's tokenizer files beside the weights, so the export loads on its own."""
    import shutil

    if spec == "byte":
        from nnx_zoo.data.tokenizers import ByteTokenizer

        ByteTokenizer().save_pretrained(out)
        return
    path = os.path.expanduser(spec)
    directory = path if os.path.isdir(path) else os.path.dirname(path)
    for name in _TOKENIZER_FILES:
        src = os.path.join(directory, name)
        if os.path.exists(src):
            shutil.copy(src, os.path.join(out, name))
