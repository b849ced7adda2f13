"""Evaluate a run's checkpoint on any devices and strategy: loss, perplexity, bits per byte.

    python eval_main.py --workdir=DIR [--sharding_strategy=dp] [--mesh_shape=data:8]
        [--data=PATH] [--eval_batches=N] [--step=N]
        [--prompt="def main(" --max_new_tokens=64 --temperature=0.8 --top_k=40]
    python eval_main.py --workdir=OUT --hf_checkpoint=HF_DIR [--data=PATH] [--prompt=...]
    python eval_main.py --workdir=DIR --tasks=zoo_facts,hellaswag [--include_path=lm_eval_tasks]
        [--num_fewshot=0] [--limit=N]    (lm-evaluation-harness: DIR/lm_eval.json)

The model config, tokenizer, sequence length, batch size and data source come from the run's
own record (the `run_info` saved in the checkpoint's meta); the flags override the runtime
choices only. Parameters alone are restored (no optimizer state), straight into the layout of
the requested strategy and mesh. Evaluation is one pass over the validation split of the run's
training data (or all of `--data`) in file order, so it is the same on every mesh: the same
`eval_batches` batches of the run's global batch size (rows of padding are added when the
batch does not divide over `data`; they count for nothing).

Prints the result, then writes DIR/eval.json atomically: step, loss (mean next-token NLL in
nats), perplexity, bits_per_byte (NLL in bits over the UTF-8 bytes the predicted tokens stand
for; null when the tokenizer gives no byte counts), tokens, bytes, `non_finite` (the keys
whose value was NaN or inf, written as null, with a warning), and the generation
when `--prompt` is given (also printed). `--noevaluate --prompt=...` only generates, and
writes nothing. The checkpoint's files are checked against the checksums written with it; a
damaged one is named, with the other steps `--step` can choose. A bad flag, strategy, mesh,
path or checkpoint ends with exit status 2 and one line on stderr; the library code is in
nnx_zoo/evaluation/.
"""

from __future__ import annotations

from nnx_zoo.launch import cli

cli.preamble()

FLAGS = cli.new_flags()

LOAD = cli.define_load_flags(
    FLAGS,
    workdir_help="Run directory (checkpoints/ and eval.json).",
    hf_help="Evaluate a Hugging Face checkpoint directory instead of the run's.",
)
EVAL = cli.define_flags(
    FLAGS,
    (
        "data",
        str,
        None,
        "Held-out data (path / dir / glob; all of it); default: the run's validation.",
    ),
    ("eval_batches", int, None, "Batches; default: the run's."),
    ("batch_size", int, None, "Rows per batch; default: the run's."),
    ("seq_len", int, None, "Tokens per row; default: the run's."),
    ("loss_chunk_size", int, None, "Tokens per device per LM-head+loss chunk (0: full logits)."),
    ("prompt", str, None, "Text to continue (greedy unless --temperature)."),
    ("max_new_tokens", int, 64, "Tokens to generate."),
    ("temperature", float, 0.0, "0: greedy; > 0: sampling."),
    ("top_k", int, 0, "Sample among the k most likely tokens; 0: all."),
    ("seed", int, 0, "Sampling seed (--prompt, and --tasks that sample)."),
    ("tasks", str, None, "lm-eval tasks, comma-separated: run them (not the held-out metrics)."),
    (
        "include_path",
        str,
        None,
        "Directory of local task YAML; lm_eval_tasks: the shipped examples.",
    ),
    ("num_fewshot", int, None, "Few-shot examples; default: task's."),
    ("limit", float, None, "Examples per task (N, or a fraction if < 1)."),
    (
        "evaluate",
        bool,
        True,
        "Compute the held-out metrics; --noevaluate with --prompt only generates.",
    ),
)


def _request():
    from nnx_zoo.checkpoint.workdir import expand
    from nnx_zoo.evaluation.run import EvalRequest, Generation

    if not LOAD.workdir.value:
        cli.usage_error("--workdir is required (the run directory; eval.json is written there)")
    generation = None
    if EVAL.prompt.value is not None:
        generation = Generation(
            **EVAL.values("prompt", "max_new_tokens", "temperature", "top_k", "seed")
        )
    overrides = LOAD.overrides() | EVAL.values(
        "data", "loss_chunk_size", "seq_len", "batch_size", "eval_batches"
    )
    return EvalRequest(
        workdir=expand(LOAD.workdir.value),
        hf_checkpoint=LOAD.hf_dir(),
        step=LOAD.step.value,
        evaluate=EVAL.evaluate.value,
        generation=generation,
        overrides=overrides,
    )


@cli.quiet_logging()
def main(argv):
    cli.no_arguments(argv)
    from nnx_zoo.evaluation import run as evaluation
    from nnx_zoo.runtime import host

    host.announce()  # the first line: the backend and devices JAX chose

    if EVAL.tasks.value is not None:  # lm-evaluation-harness tasks (nnx_zoo/evaluation/harness.py)
        _run_tasks()
        return
    request = _request()
    result = evaluation.evaluate(request)
    try:
        evaluation.report(result)
    except OSError as e:
        cli.usage_error(e)


def _run_tasks():
    from nnx_zoo.evaluation import harness

    include = harness.include_dir(EVAL.include_path.value) if EVAL.include_path.value else None
    request = _request()
    tasks = harness.prepare(EVAL.tasks.value, include, EVAL.num_fewshot.value, EVAL.limit.value)
    results, result = harness.evaluate(request, tasks, seed=EVAL.seed.value)
    try:
        harness.report(results, result)
    except OSError as e:
        cli.usage_error(e)


def run(argv: list[str] | None = None) -> None:
    """The `zoo-eval` console script: the same as `python eval_main.py ARGS`."""
    cli.run_main(main, FLAGS, doc=__doc__, argv=argv)


if __name__ == "__main__":
    run()
