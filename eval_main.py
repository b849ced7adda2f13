"""Evaluate a run's checkpoint on any devices and strategy: loss, perplexity, bits per byte.

    python eval_main.py --workdir=DIR [--sharding_strategy=dp] [--mesh_shape=data:8]
        [--data=PATH] [--eval_batches=N] [--step=N]
        [--prompt="def main(" --max_new_tokens=64 --temperature=0.8 --top_k=40]
    python eval_main.py --workdir=OUT --hf_checkpoint=HF_DIR [--data=PATH] [--prompt=...]

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
evaluation/.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

if __name__ == "__main__":
    # glibc reads its tunables when a process starts: restart now (before anything heavy is
    # loaded) with huge pages for the host allocator where that helps (runtime/cpu_memory.py).
    from runtime.cpu_memory import reexec_with_huge_pages

    reexec_with_huge_pages()

from runtime.xla_cpu import set_cpu_flags  # noqa: E402

set_cpu_flags()  # CPU dot kernels; a flag already in XLA_FLAGS wins

# Before anything imports jax: on a host with no TPU / GPU, CPU platform and no native
# start-up lines on stderr (see runtime/host.py).
from runtime.host import import_jax_quietly  # noqa: E402

import_jax_quietly()

import sys  # noqa: E402

from absl import app, flags, logging  # noqa: E402

EXIT_USAGE = 2
EVAL_FILE = "eval.json"

_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (checkpoints/ and eval.json).")
_STRATEGY = flags.DEFINE_string(
    "sharding_strategy", None, "dp | fsdp | tp | fsdp_tp | fsdp_ep; default: the run's."
)
_MESH_SHAPE = flags.DEFINE_string("mesh_shape", None, "e.g. data:8; default: the strategy's rule.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step; default: the latest complete one.")
_DATA = flags.DEFINE_string(
    "data", None, "Held-out data (path / dir / glob; all of it); default: the run's validation."
)
_EVAL_BATCHES = flags.DEFINE_integer("eval_batches", None, "Batches; default: the run's.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", None, "Rows per batch; default: the run's.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", None, "Tokens per row; default: the run's.")
_TOKENIZER = flags.DEFINE_string(
    "tokenizer", None, "'byte', tokenizer.json or .model; default: the run's (or the HF dir's)."
)
_ATTENTION = flags.DEFINE_enum(
    "attention_impl",
    None,
    ["xla", "cudnn", "splash", "auto"],
    "Attention backend; default: the run's. A backend that cannot run here is an error.",
)
_LOSS_CHUNK = flags.DEFINE_integer(
    "loss_chunk_size", None, "Tokens per device per LM-head+loss chunk (0: full logits)."
)
_PROMPT = flags.DEFINE_string("prompt", None, "Text to continue (greedy unless --temperature).")
_MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0: greedy; > 0: sampling.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Sample among the k most likely tokens; 0: all.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_HF_CHECKPOINT = flags.DEFINE_string(
    "hf_checkpoint", None, "Evaluate a Hugging Face checkpoint directory instead of the run's."
)

_EVALUATE = flags.DEFINE_bool(
    "evaluate", True, "Compute the held-out metrics; --noevaluate with --prompt only generates."
)


def _usage_error(message) -> None:
    print(f"error: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
    sys.exit(EXIT_USAGE)


def _parse_flags(argv):
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        _usage_error(e)


def _generate(model, mesh, tokenizer) -> tuple[str, int]:
    import jax

    from zoo.generate import generate

    prompt_ids = tokenizer.encode(_PROMPT.value)
    if not prompt_ids:
        raise ValueError("--prompt is empty after tokenization")
    with jax.set_mesh(mesh):
        new_ids = generate(
            model,
            [prompt_ids],
            max_new_tokens=_MAX_NEW_TOKENS.value,
            temperature=_TEMPERATURE.value,
            top_k=_TOP_K.value or None,
            eos_id=tokenizer.eos_id,
            seed=_SEED.value,
        )[0]
    return tokenizer.decode(new_ids), len(new_ids)


def main(argv):
    if len(argv) > 1:
        _usage_error(f"unexpected arguments {argv[1:]}; flags look like --name=value")
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)
    if not _WORKDIR.value:
        _usage_error("--workdir is required (the run directory; eval.json is written there)")
    if not _EVALUATE.value and _PROMPT.value is None:
        _usage_error("--noevaluate leaves nothing to do without --prompt")
    from checkpoint.workdir import check_writable_everywhere, expand

    workdir = expand(_WORKDIR.value)
    hf_dir = expand(_HF_CHECKPOINT.value) if _HF_CHECKPOINT.value else None
    try:
        import jax

        from checkpoint.manager import read_meta
        from data.tokenizers import make_tokenizer
        from evaluation import metrics as eval_metrics
        from evaluation import model as eval_model
        from evaluation.settings import from_run_info
        from training.run import device_hint
        from zoo.generate import check_can_generate

        if _PROMPT.value is not None and _STRATEGY.value:
            check_can_generate(_STRATEGY.value)  # before reading the checkpoint
        if _EVALUATE.value:
            check_writable_everywhere(workdir)  # before the work, not after it
        run_info, step = None, None
        if hf_dir is None:
            step, meta = read_meta(workdir, _STEP.value)
            run_info = meta.get("run_info") or {}
        settings = from_run_info(
            run_info,
            hf_checkpoint=hf_dir,
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
        if _PROMPT.value is not None:
            check_can_generate(settings.strategy)
        if _TOP_K.value < 0 or _TEMPERATURE.value < 0 or _MAX_NEW_TOKENS.value < 1:
            raise ValueError("--top_k and --temperature must be >= 0, --max_new_tokens >= 1")
        tokenizer = make_tokenizer(settings.tokenizer)
        if hf_dir is not None:
            model, mesh = eval_model.load_from_hf(hf_dir, settings)
        else:
            model, mesh, step = eval_model.load_from_checkpoint(workdir, run_info, settings, step)
        metrics = None
        if _EVALUATE.value:
            metrics = eval_metrics.json_safe(
                eval_metrics.evaluate(model, mesh, settings, tokenizer)
            )
        generated = _generate(model, mesh, tokenizer) if _PROMPT.value is not None else None
    except (ValueError, FileNotFoundError, NotADirectoryError) as e:
        _usage_error(device_hint(e))

    if jax.process_index() != 0:
        return
    what = f"hf checkpoint {hf_dir}" if hf_dir else f"step {step}"
    where = f"{settings.strategy} on {dict(mesh.shape)}"
    if metrics is not None:
        # Printed before eval.json is written: a failed write must not lose the result.
        print(f"{what}: {eval_metrics.summary(metrics)} ({where})", flush=True)
    if generated is not None:
        print(f"{_PROMPT.value}{generated[0]}", flush=True)
    if metrics is None:
        return
    record = {
        "step": step,
        **metrics,
        "data": settings.source,
        "split": settings.split,
        "eval_batches": settings.eval_batches,
        "batch_size": settings.batch_size,
        "seq_len": settings.seq_len,
        "strategy": settings.strategy,
        "mesh_shape": dict(mesh.shape),
        "num_devices": jax.device_count(),
        "hf_checkpoint": hf_dir,
    }
    if generated is not None:
        record.update(prompt=_PROMPT.value, generated=generated[0], generated_tokens=generated[1])
    from checkpoint.files import write_json_atomic

    path = os.path.join(workdir, EVAL_FILE)
    try:
        write_json_atomic(path, record)
    except OSError as e:
        _usage_error(f"cannot write {path} ({e.strerror or e}); the result is printed above")
    print(f"wrote {path}", flush=True)
    if metrics["non_finite"]:
        print(
            f"warning: {', '.join(metrics['non_finite'])} not finite (null in eval.json, listed "
            "under non_finite): the parameters have diverged",
            file=sys.stderr,
            flush=True,
        )


if __name__ == "__main__":
    app.run(main, flags_parser=_parse_flags)
