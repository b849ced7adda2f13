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

from absl import flags  # noqa: E402

FLAGS = cli.new_flags()

_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Run directory (checkpoints/ and eval.json).", flag_values=FLAGS
)
_STRATEGY = cli.strategy_flag(FLAGS, "; default: the run's.")
_MESH_SHAPE = cli.mesh_shape_flag(FLAGS, "the strategy's rule")
_STEP = flags.DEFINE_integer(
    "step", None, "Checkpoint step; default: the latest complete one.", flag_values=FLAGS
)
_DATA = flags.DEFINE_string(
    "data",
    None,
    "Held-out data (path / dir / glob; all of it); default: the run's validation.",
    flag_values=FLAGS,
)
_EVAL_BATCHES = flags.DEFINE_integer(
    "eval_batches", None, "Batches; default: the run's.", flag_values=FLAGS
)
_BATCH_SIZE = flags.DEFINE_integer(
    "batch_size", None, "Rows per batch; default: the run's.", flag_values=FLAGS
)
_SEQ_LEN = flags.DEFINE_integer(
    "seq_len", None, "Tokens per row; default: the run's.", flag_values=FLAGS
)
_TOKENIZER = flags.DEFINE_string(
    "tokenizer",
    None,
    "'byte', tokenizer.json or .model; default: the run's (or the HF dir's).",
    flag_values=FLAGS,
)
_ATTENTION = cli.attention_flag(FLAGS, "the run's")
_LOSS_CHUNK = flags.DEFINE_integer(
    "loss_chunk_size",
    None,
    "Tokens per device per LM-head+loss chunk (0: full logits).",
    flag_values=FLAGS,
)
_PROMPT = flags.DEFINE_string(
    "prompt", None, "Text to continue (greedy unless --temperature).", flag_values=FLAGS
)
_MAX_NEW_TOKENS = flags.DEFINE_integer(
    "max_new_tokens", 64, "Tokens to generate.", flag_values=FLAGS
)
_TEMPERATURE = flags.DEFINE_float(
    "temperature", 0.0, "0: greedy; > 0: sampling.", flag_values=FLAGS
)
_TOP_K = flags.DEFINE_integer(
    "top_k", 0, "Sample among the k most likely tokens; 0: all.", flag_values=FLAGS
)
_SEED = flags.DEFINE_integer(
    "seed", 0, "Sampling seed (--prompt, and --tasks that sample).", flag_values=FLAGS
)
_HF_CHECKPOINT = flags.DEFINE_string(
    "hf_checkpoint",
    None,
    "Evaluate a Hugging Face checkpoint directory instead of the run's.",
    flag_values=FLAGS,
)

_TASKS = flags.DEFINE_string(
    "tasks",
    None,
    "lm-eval tasks, comma-separated: run them (not the held-out metrics).",
    flag_values=FLAGS,
)
_INCLUDE_PATH = flags.DEFINE_string(
    "include_path",
    None,
    "Directory of local task YAML; lm_eval_tasks: the shipped examples.",
    flag_values=FLAGS,
)
_NUM_FEWSHOT = flags.DEFINE_integer(
    "num_fewshot", None, "Few-shot examples; default: task's.", flag_values=FLAGS
)
_LIMIT = flags.DEFINE_float(
    "limit", None, "Examples per task (N, or a fraction if < 1).", flag_values=FLAGS
)

_EVALUATE = flags.DEFINE_bool(
    "evaluate",
    True,
    "Compute the held-out metrics; --noevaluate with --prompt only generates.",
    flag_values=FLAGS,
)


def _request():
    from nnx_zoo.checkpoint.workdir import expand
    from nnx_zoo.evaluation.run import EvalRequest, Generation

    if not _WORKDIR.value:
        cli.usage_error("--workdir is required (the run directory; eval.json is written there)")
    generation = None
    if _PROMPT.value is not None:
        generation = Generation(
            prompt=_PROMPT.value,
            max_new_tokens=_MAX_NEW_TOKENS.value,
            temperature=_TEMPERATURE.value,
            top_k=_TOP_K.value,
            seed=_SEED.value,
        )
    overrides = dict(
        data=_DATA.value,
        mesh_shape=_MESH_SHAPE.value,
        attention_impl=_ATTENTION.value,
        strategy=_STRATEGY.value,
        loss_chunk_size=_LOSS_CHUNK.value,
        tokenizer=_TOKENIZER.value,
        seq_len=_SEQ_LEN.value,
        batch_size=_BATCH_SIZE.value,
        eval_batches=_EVAL_BATCHES.value,
    )
    return EvalRequest(
        workdir=expand(_WORKDIR.value),
        hf_checkpoint=expand(_HF_CHECKPOINT.value) if _HF_CHECKPOINT.value else None,
        step=_STEP.value,
        evaluate=_EVALUATE.value,
        generation=generation,
        overrides=overrides,
    )


def main(argv):
    cli.no_arguments(argv)
    cli.quiet_logging()
    from nnx_zoo.evaluation import run as evaluation

    if _TASKS.value is not None:  # lm-evaluation-harness tasks (nnx_zoo/evaluation/harness.py)
        _run_tasks()
        return
    try:
        request = _request()
        result = evaluation.evaluate(request)
    except (ValueError, FileNotFoundError, NotADirectoryError) as e:
        cli.usage_error(cli.device_hint(e))
    try:
        evaluation.report(result)
    except OSError as e:
        cli.usage_error(e)


def _run_tasks():
    from nnx_zoo.evaluation import harness

    try:
        include = harness.include_dir(_INCLUDE_PATH.value) if _INCLUDE_PATH.value else None
        request = _request()
        tasks = harness.prepare(_TASKS.value, include, _NUM_FEWSHOT.value, _LIMIT.value)
        results, result = harness.evaluate(request, tasks, seed=_SEED.value)
    except (ValueError, FileNotFoundError, NotADirectoryError) as e:
        cli.usage_error(cli.device_hint(e))
    try:
        harness.report(results, result)
    except OSError as e:
        cli.usage_error(e)


def run(argv: list[str] | None = None) -> None:
    """The `zoo-eval` console script: the same as `python eval_main.py ARGS`."""
    cli.run_main(main, FLAGS, doc=__doc__, argv=argv)


if __name__ == "__main__":
    run()
