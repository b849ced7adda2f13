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

Writes DIR/eval.json atomically: step, loss (mean next-token NLL in nats), perplexity,
bits_per_byte (NLL in bits over the UTF-8 bytes the predicted tokens stand for; null when
the tokenizer gives no byte counts), tokens, bytes, and the generation when `--prompt` is
given (also printed). A bad flag, strategy, mesh, path or checkpoint ends with exit status 2
and one line on stderr.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from training.xla_cpu import set_cpu_flags  # noqa: E402

set_cpu_flags()  # CPU dot kernels; a flag already in XLA_FLAGS wins

# Before anything imports jax: on a host with no TPU / GPU, CPU platform and no native
# start-up lines on stderr (see training/host.py).
from training.host import import_jax_quietly  # noqa: E402

import_jax_quietly()

import dataclasses  # noqa: E402
import math  # noqa: E402
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
_PROMPT = flags.DEFINE_string("prompt", None, "Text to continue (greedy unless --temperature).")
_MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0: greedy; > 0: sampling.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Sample among the k most likely tokens; 0: all.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_ATTENTION = flags.DEFINE_enum(
    "attention_impl",
    None,
    ["xla", "splash", "cudnn", "auto"],
    "Attention backend (splash: TPU, cudnn: NVIDIA GPU, auto: the platform's); default: the "
    "run's (a Hugging Face checkpoint: auto).",
)
_HF_CHECKPOINT = flags.DEFINE_string(
    "hf_checkpoint", None, "Evaluate a Hugging Face checkpoint directory instead of the run's."
)

# Defaults for a Hugging Face checkpoint, which has no run record.
_HF_DEFAULTS = dict(source="default", seq_len=512, global_batch_size=8, eval_batches=4)


def _usage_error(message) -> None:
    print(f"error: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
    sys.exit(EXIT_USAGE)


def _parse_flags(argv):
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        _usage_error(e)


# ----------------------------------------------------------------------------- settings


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    strategy: str
    mesh_shape: str | None
    source: str
    split: str
    tokenizer: str
    text_field: str
    validation_fraction: float
    seq_len: int
    batch_size: int
    eval_batches: int


def model_config_from_run_info(run_info: dict):
    """The zoo config the run trained: `run_info['model_config']` when recorded (type name
    and fields), else the run config's model section (`RunConfig.model.decoder_config()`)."""
    recorded = run_info.get("model_config")
    if recorded:
        from zoo.registry import config_types

        types = config_types()
        fields = dict(recorded)
        name = fields.pop("type", None)
        if name not in types:
            raise ValueError(f"checkpoint model config type {name!r} is not in this zoo ({types})")
        config_type = types[name]
        for field in dataclasses.fields(config_type):
            if isinstance(fields.get(field.name), list):  # JSON turned tuples into lists
                fields[field.name] = tuple(fields[field.name])
        return config_type(**fields)
    return _run_config(run_info).model.decoder_config()


def _run_config(run_info: dict):
    from training.config import RunConfig

    if "config" not in run_info:
        raise ValueError("the checkpoint's run_info records no 'config'; cannot rebuild the run")
    return RunConfig.from_config_dict(run_info["config"])


def settings_from_flags(run_info: dict | None) -> EvalSettings:
    if run_info is not None:
        run = _run_config(run_info)
        d = run.data
        base = dict(
            strategy=run_info.get("strategy", run.training.sharding_strategy),
            source=d.source,
            tokenizer=d.tokenizer,
            text_field=d.text_field,
            validation_fraction=d.validation_fraction,
            seq_len=d.seq_len,
            batch_size=d.global_batch_size,
            eval_batches=run.training.eval_batches,
        )
    else:
        base = dict(
            strategy="fsdp_tp",
            source=_HF_DEFAULTS["source"],
            tokenizer=_HF_CHECKPOINT.value,
            text_field="text",
            validation_fraction=0.02,
            seq_len=_HF_DEFAULTS["seq_len"],
            batch_size=_HF_DEFAULTS["global_batch_size"],
            eval_batches=_HF_DEFAULTS["eval_batches"],
        )
    for key, flag in (
        ("strategy", _STRATEGY),
        ("tokenizer", _TOKENIZER),
        ("seq_len", _SEQ_LEN),
        ("batch_size", _BATCH_SIZE),
        ("eval_batches", _EVAL_BATCHES),
    ):
        if flag.value is not None:
            base[key] = flag.value
    for key in ("seq_len", "batch_size", "eval_batches"):
        if base[key] < 1:
            raise ValueError(f"--{key}={base[key]} must be >= 1")
    source = _DATA.value or base.pop("source")
    base.pop("source", None)
    return EvalSettings(
        mesh_shape=_MESH_SHAPE.value,
        source=source,
        split="all" if _DATA.value else "validation",
        **base,
    )


# ----------------------------------------------------------------------------- the work


def load_model(workdir: str, run_info: dict | None, settings: EvalSettings, step: int | None):
    """(model, mesh, step): the model built under the requested strategy/mesh, with the
    checkpoint's (or the HF directory's) parameters."""
    import jax
    from flax import nnx

    from shardings import get_strategy
    from training.checkpoint import restore_params
    from training.run import check_attention
    from zoo import create_model
    from zoo.build import check_model_fits, model_class

    strategy = get_strategy(settings.strategy)
    if _HF_CHECKPOINT.value:
        from zoo import from_pretrained
        from zoo.hf_io import read_config

        if not os.path.isdir(_HF_CHECKPOINT.value):
            raise FileNotFoundError(f"--hf_checkpoint={_HF_CHECKPOINT.value!r} is not a directory")
        cfg = read_config(_HF_CHECKPOINT.value)
        mesh = strategy.make_mesh(shape=settings.mesh_shape, config=cfg)
        runtime = {"attention_impl": _ATTENTION.value} if _ATTENTION.value else {}
        with jax.set_mesh(mesh):
            model = from_pretrained(_HF_CHECKPOINT.value, strategy, **runtime)
        check_attention(model.cfg, mesh, settings.seq_len)
        return model, mesh, None

    cfg = model_config_from_run_info(run_info)
    if _ATTENTION.value:
        cfg = dataclasses.replace(cfg, attention_impl=_ATTENTION.value)
    mesh = strategy.make_mesh(shape=settings.mesh_shape, config=cfg)
    # A backend that cannot run here: one line now, not an error deep in the compile.
    check_attention(cfg, mesh, settings.seq_len)
    check_model_fits(cfg, strategy, mesh)
    with jax.set_mesh(mesh):
        # Shapes only: the checkpoint's arrays are read straight into the layout, so the model
        # is never initialised (and never held twice).
        model = nnx.eval_shape(
            lambda: model_class(cfg)(cfg, strategy.lm_sharding(), rngs=nnx.Rngs(0))
        )
        step = restore_params(workdir, model, step)
        if not all(isinstance(x, jax.Array) for x in jax.tree.leaves(nnx.state(model))):
            # State besides the parameters (none in today's families) needs real values.
            model = create_model(cfg, strategy, rngs=nnx.Rngs(0))
            step = restore_params(workdir, model, step)
    return model, mesh, step


def evaluate(model, mesh, settings: EvalSettings, tokenizer) -> dict:
    """Loss, perplexity, bits per byte and counts over the settings' batches."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from shardings.mesh import check_batch
    from training import data
    from training.distributed import to_global
    from zoo.loss import target_mask, token_nll

    if model.cfg.vocab_size < tokenizer.vocab_size:
        raise ValueError(
            f"model vocab_size={model.cfg.vocab_size} is smaller than the tokenizer's "
            f"{tokenizer.vocab_size} ids"
        )
    batch_spec = model.sharding.tokens
    rows = settings.batch_size
    multiple = 1
    if batch_spec[0] is not None:
        axes = batch_spec[0] if isinstance(batch_spec[0], tuple) else (batch_spec[0],)
        multiple = math.prod(mesh.shape[a] for a in axes)
    padded_rows = -(-rows // multiple) * multiple  # same data on every mesh, padding rows added
    check_batch(padded_rows, batch_spec, mesh, settings.strategy, seq_len=settings.seq_len)
    dataset = data.build_dataset(
        settings.source,
        settings.split,
        tokenizer,
        settings.seq_len,
        rows,
        shuffle=False,
        repeat=False,
        num_batches=settings.eval_batches,
        text_field=settings.text_field,
        validation_fraction=settings.validation_fraction,
    )
    graphdef, state = nnx.split(model)

    @jax.jit
    def nll_sum(state, batch):
        m = nnx.merge(graphdef, state)
        logits_BTV = m(
            batch["tokens"], segment_ids=batch["segment_ids"], positions=batch["positions"]
        )
        nll_BT, mask_BT = token_nll(logits_BTV, batch["tokens"], batch["segment_ids"])
        return jnp.sum(nll_BT), jnp.sum(mask_BT)

    total_nll, total_tokens, total_bytes = 0.0, 0, 0
    with jax.set_mesh(mesh):
        for local in dataset:
            short = padded_rows // jax.process_count() - local["tokens"].shape[0]
            if short > 0:
                local = {
                    k: np.concatenate([v, np.zeros((short, v.shape[1]), v.dtype)])
                    for k, v in local.items()
                }
            nll, count = nll_sum(state, to_global(local, mesh, batch_spec))
            total_nll += float(nll)
            total_tokens += int(count)
            # Bytes the predicted (target) tokens stand for; this process's rows, summed over
            # processes below.
            targets_BT, mask_BT = (
                np.asarray(a) for a in target_mask(local["tokens"], local["segment_ids"])
            )
            total_bytes += int(tokenizer.token_num_bytes[targets_BT[mask_BT]].sum())
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        total_bytes = int(np.sum(multihost_utils.process_allgather(np.int64(total_bytes))))
    if total_tokens == 0:
        raise ValueError(f"no tokens to evaluate in {settings.source!r} ({settings.split})")
    loss = total_nll / total_tokens
    return {
        "loss": loss,
        "perplexity": math.exp(min(loss, 700.0)),
        "bits_per_byte": (total_nll / math.log(2) / total_bytes) if total_bytes else None,
        "tokens": total_tokens,
        "bytes": total_bytes,
    }


def main(argv):
    if len(argv) > 1:
        _usage_error(f"unexpected arguments {argv[1:]}; flags look like --name=value")
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)
    if not _WORKDIR.value:
        _usage_error("--workdir is required (the run directory; eval.json is written there)")
    workdir = os.path.abspath(os.path.expanduser(_WORKDIR.value))
    try:
        import jax

        from training.checkpoint import read_meta
        from training.tokenizers import make_tokenizer

        run_info, step = None, None
        if not _HF_CHECKPOINT.value:
            step, meta = read_meta(workdir, _STEP.value)
            run_info = meta.get("run_info") or {}
        settings = settings_from_flags(run_info)
        if _TOP_K.value < 0 or _TEMPERATURE.value < 0 or _MAX_NEW_TOKENS.value < 1:
            raise ValueError("--top_k and --temperature must be >= 0, --max_new_tokens >= 1")
        tokenizer = make_tokenizer(settings.tokenizer)
        model, mesh, step = load_model(workdir, run_info, settings, step)
        metrics = evaluate(model, mesh, settings, tokenizer)
        generated = None
        if _PROMPT.value is not None:
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
            generated = tokenizer.decode(new_ids)
    except (ValueError, FileNotFoundError, NotADirectoryError) as e:
        _usage_error(e)

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
        "hf_checkpoint": _HF_CHECKPOINT.value,
    }
    if generated is not None:
        record.update(prompt=_PROMPT.value, generated=generated, generated_tokens=len(new_ids))
    if jax.process_index() == 0:
        from training.files import write_json_atomic

        write_json_atomic(os.path.join(workdir, EVAL_FILE), record)
        bpb = metrics["bits_per_byte"]
        print(
            f"step {step}: loss {metrics['loss']:.4f}, perplexity {metrics['perplexity']:.3f}, "
            f"bits/byte {'n/a' if bpb is None else f'{bpb:.4f}'}, {metrics['tokens']} tokens "
            f"({settings.strategy} on {dict(mesh.shape)}); wrote "
            f"{os.path.join(workdir, EVAL_FILE)}",
            flush=True,
        )
        if generated is not None:
            print(f"{_PROMPT.value}{generated}", flush=True)


if __name__ == "__main__":
    app.run(main, flags_parser=_parse_flags)
