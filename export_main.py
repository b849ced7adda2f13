"""Export a run's checkpoint to Hugging Face formats.

    python export_main.py --workdir=DIR [--step=N] --format=hf|peft --out=OUT [--overwrite]

hf: a merged Hugging Face checkpoint (config.json + safetensors, and the run's tokenizer
files), for any run; a LoRA run's adapters are folded into the base weights. transformers'
`AutoModelForCausalLM.from_pretrained(OUT)` loads it.
peft: a LoRA run's adapters as `adapter_model.safetensors` + `adapter_config.json`, which
`peft.PeftModel.from_pretrained(base_model, OUT)` loads onto the base (the run's --init_from).

OUT must be new or empty: a file, a run's workdir (or a path inside its checkpoints/,
metrics.jsonl, ...) or a directory holding anything is refused, and nothing is written;
`--overwrite` replaces an earlier export at OUT (only the files its manifest,
OUT/.zoo-output.json, lists; anything else there is refused). The export is written beside
OUT and renamed into place whole, so a failure leaves the earlier export, or nothing.

A bad flag, workdir, format or --out ends with exit status 2 and one line on stderr; the
library code is in nnx_zoo/export/.
"""

from __future__ import annotations

from nnx_zoo.launch import cli

cli.preamble()

FLAGS = cli.new_flags()

EXPORT = cli.define_flags(
    FLAGS,
    ("workdir", str, None, "Run directory (its checkpoints/)."),
    cli.STEP,
    ("format", str, None, "hf (merged checkpoint) | peft (LoRA adapter)."),
    (
        "out",
        str,
        None,
        "Directory to write: a new or empty one (not a file, nor a run's workdir or its files).",
    ),
    (
        "overwrite",
        bool,
        False,
        "Replace an earlier export at --out (only what it wrote, as its manifest lists).",
    ),
)


@cli.quiet_logging()
def main(argv):
    cli.no_arguments(argv)
    for flag in (EXPORT.workdir, EXPORT.format, EXPORT.out):
        if not flag.value:
            cli.usage_error(f"--{flag.name} is required (--workdir=DIR --format=hf|peft --out=OUT)")
    from nnx_zoo.checkpoint.workdir import expand
    from nnx_zoo.export import export_run
    from nnx_zoo.runtime import host

    host.announce()  # the first line: the backend and devices JAX chose

    try:
        out = expand(EXPORT.out.value)
        step = export_run(
            expand(EXPORT.workdir.value),
            out,
            EXPORT.format.value,
            EXPORT.step.value,
            overwrite=EXPORT.overwrite.value,
        )
    except OSError as e:  # --out's directory cannot be written (permissions, a full disk)
        cli.usage_error(f"--out={EXPORT.out.value}: cannot write the export ({e.strerror or e})")
    print(f"wrote step {step} as {EXPORT.format.value} to {out}", flush=True)


def run(argv: list[str] | None = None) -> None:
    """The `zoo-export` console script: the same as `python export_main.py ARGS`."""
    cli.run_main(main, FLAGS, doc=__doc__, argv=argv)


if __name__ == "__main__":
    run()
