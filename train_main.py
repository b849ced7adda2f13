"""Train a language model: flags -> config -> mesh -> model -> loop.

    python train_main.py --config=configs/tiny.py --sharding_strategy=fsdp_tp --workdir=DIR \
        [--config.optimizer.learning_rate=1e-3] [--mesh_shape=data:4,model:2]

Writes DIR/metrics.jsonl, DIR/tensorboard/, DIR/loss_curve.png and DIR/checkpoints/ (process 0
writes the files; every process takes part in checkpoints). Run again with the same workdir and
it resumes from the latest checkpoint. A bad flag, strategy, mesh, data path or config ends with
exit status 2 and one line on stderr.
"""

from __future__ import annotations

import os

# Before jax is imported: keep XLA's C++ start-up chatter off stderr, which carries errors.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import dataclasses  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CONFIG = os.path.join(HERE, "configs", "tiny.py")
EXIT_USAGE = 2


def _usage_error(message: str):
    """One line on stderr, exit status 2: for every mistake in what the user gave us."""
    print(f"error: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
    sys.exit(EXIT_USAGE)


def _define_config_flag():
    # config_flags applies `--config.<path>=value` overrides while defining the flag (it reads
    # sys.argv), so a misspelt field raises here, before absl parses anything.
    try:
        return config_flags.DEFINE_config_file(
            "config", DEFAULT_CONFIG, "Run config file (a get_config() module).", lock_config=True
        )
    except (AttributeError, KeyError) as e:
        bad = [a.split("=")[0] for a in sys.argv[1:] if a.startswith("--config.")]
        name = str(e).split("\\n")[0].split("\n")[0].strip("'\"\\")
        culprit = next((b for b in bad if name in b.split(".")), ", ".join(bad) or "--config.*")
        parts = str(e).replace("\\n", " ").split("Did you mean", 1)
        suggestion = parts[1].strip(" \"'") if len(parts) == 2 else ""
        hint = f" (did you mean {suggestion})" if suggestion else ""
        _usage_error(f"{culprit}: no such config field {name!r}{hint}")


_CONFIG = _define_config_flag()
_STRATEGY = flags.DEFINE_string(
    "sharding_strategy", None, "dp | fsdp | tp | fsdp_tp; default: config.training."
)
_MESH_SHAPE = flags.DEFINE_string(
    "mesh_shape", None, "e.g. data:4,model:2; default: config.training.mesh_shape or the rule."
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory; default ./runs/<config name>.")
_ATTENTION = flags.DEFINE_enum(
    "attention_impl", None, ["xla", "cudnn", "auto"], "Attention backend; default: config."
)
_PEAK_TFLOPS = flags.DEFINE_float(
    "peak_tflops", None, "Peak TFLOP/s per device for MFU; default: table, or measured on CPU."
)
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "host:port of process 0, for several processes."
)
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in the run.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index.")
_INIT_FROM = flags.DEFINE_string(
    "init_from", None, "A Hugging Face checkpoint directory to start from (zoo.from_pretrained)."
)


def _parse_flags(argv):
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        _usage_error(e)
    except (OSError, AttributeError) as e:  # config_flags could not load the --config file
        _config_file_error(e)


def _config_file_error(error: Exception):
    """One line for a --config file that did not load (config_flags' message spans lines)."""
    given = [a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--config=")]
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    reason = next((line for line in lines if line.startswith("[Errno")), lines[-1])
    name = given[-1] if given else DEFAULT_CONFIG
    _usage_error(f"--config={name}: cannot load the config file: {reason}")


def _say(text: str) -> None:
    import jax

    if jax.process_index() == 0:
        print(text, flush=True)


def _load_config():
    """The typed run config, with the command line's choices folded in."""
    from training.config import RunConfig

    try:
        # config_flags defers a failed load of the file to the first use of the config.
        run = RunConfig.from_config_dict(_CONFIG.value)
    except OSError as e:
        _config_file_error(e)
    training, model, logging = run.training, run.model, run.logging
    if _STRATEGY.value is not None:
        training = type(training)(**{**vars(training), "sharding_strategy": _STRATEGY.value})
    if _MESH_SHAPE.value is not None:
        training = type(training)(**{**vars(training), "mesh_shape": _MESH_SHAPE.value})
    if _ATTENTION.value is not None:
        model = type(model)(**{**vars(model), "attention_impl": _ATTENTION.value})
    if _PEAK_TFLOPS.value is not None:
        logging = type(logging)(**{**vars(logging), "peak_tflops": _PEAK_TFLOPS.value})
    return type(run)(**{**vars(run), "training": training, "model": model, "logging": logging})


def _make_checkpointer(run, workdir: str, run_info: dict):
    if not run.checkpoint.enabled:
        return None, None
    try:
        from training.checkpoint import Checkpointer
    except ImportError:
        _say("note: training/checkpoint.py is not in this checkout; running without checkpoints")
        return None, None
    ckpt = Checkpointer(
        workdir,
        save_every=run.checkpoint.every,
        keep=run.checkpoint.keep,
        run_info=run_info,
        async_save=run.checkpoint.async_save,
    )
    try:
        from training.preemption import PreemptionWatcher
    except ImportError:
        return ckpt, None
    import jax

    # With several processes every check is a host all-gather, a sync point: check only at
    # logging steps, where the loop blocks anyway. Alone, a check is free.
    every = 1 if jax.process_count() == 1 else run.logging.log_every
    return ckpt, PreemptionWatcher(check_every=every)


class Setup:
    """Everything `main` builds before the first step; every mistake in the inputs surfaces
    here as ValueError / FileNotFoundError (turned into exit status 2 by `main`)."""

    def __init__(self, run, workdir: str, *, init_from: str | None = None):
        import jax
        from flax import nnx

        from shardings import check_batch, get_strategy
        from training import data, flops, optim
        from training.distributed import to_global
        from training.loop import Trainer
        from training.tokenizers import make_tokenizer

        self.run, self.workdir = run, workdir
        strategy = get_strategy(run.training.sharding_strategy)
        model_cfg = run.model.decoder_config()
        mesh = strategy.make_mesh(shape=run.training.mesh_shape or None, config=model_cfg)
        self.strategy, self.mesh = strategy, mesh
        batch_spec = strategy.batch_spec()
        self.batch_spec = batch_spec
        micro_batch = run.data.global_batch_size // run.optimizer.micro_batches
        check_batch(micro_batch, batch_spec, mesh, strategy.name)

        tokenizer = make_tokenizer(run.data.tokenizer)
        common = dict(
            tokenizer=tokenizer,
            seq_len=run.data.seq_len,
            global_batch_size=run.data.global_batch_size,
            seed=run.data.shuffle_seed,
            text_field=run.data.text_field,
            validation_fraction=run.data.validation_fraction,
        )
        self.train_iter = data.make_dataset(
            run.data.source, "train", num_workers=run.data.num_workers, **common
        )
        # Built once here so a source with no validation documents fails before training.
        val_dataset = data.build_dataset(
            run.data.source, "validation", num_batches=run.training.eval_batches, **common
        )
        self.make_val_batches = lambda: (to_global(b, mesh, batch_spec) for b in val_dataset)
        self.train_batches = (to_global(b, mesh, batch_spec) for b in self.train_iter)

        with jax.set_mesh(mesh):
            if init_from:
                model = _from_pretrained(init_from, strategy, run.model)
                model_cfg = model.cfg
            else:
                model = _create_model(model_cfg, strategy, run.training.seed)
            if model_cfg.vocab_size < tokenizer.vocab_size:
                fix = (
                    "use the checkpoint's own tokenizer (--config.data.tokenizer=<its dir>)"
                    if init_from
                    else f"set --config.model.vocab_size >= {tokenizer.vocab_size}"
                )
                raise ValueError(
                    f"model vocab_size={model_cfg.vocab_size} is smaller than the tokenizer's "
                    f"{tokenizer.vocab_size} ids ({run.data.tokenizer}); {fix}"
                )
            tx, self.schedule = optim.make_optimizer(
                learning_rate=run.optimizer.learning_rate,
                warmup_steps=run.optimizer.warmup_steps,
                total_steps=run.decay_steps,
                end_learning_rate_ratio=run.optimizer.end_learning_rate_ratio,
                b1=run.optimizer.b1,
                b2=run.optimizer.b2,
                eps=run.optimizer.eps,
                weight_decay=run.optimizer.weight_decay,
                clip_grad_norm=run.optimizer.clip_grad_norm,
                decay_norms_and_embeddings=run.optimizer.decay_norms_and_embeddings,
            )
            optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        self.model_cfg, self.model, self.optimizer = model_cfg, model, optimizer
        self.trainer = Trainer(
            model, optimizer, micro_batches=run.optimizer.micro_batches, batch_spec=batch_spec
        )
        # One formula for model FLOPs: the config's (6 * matmul params + causal attention).
        self.flops_per_token = model_cfg.flops_per_token(run.data.seq_len)
        self.peak_per_device = flops.peak_flops_per_device(
            jax.devices()[0], dtype=model_cfg.compute_dtype, override_tflops=run.logging.peak_tflops
        )
        self.run_info = {
            "config": run.to_dict(),
            "strategy": strategy.name,
            "mesh_shape": dict(mesh.shape),
            "num_devices": jax.device_count(),
            "num_processes": jax.process_count(),
            "model": model_cfg.describe(),
            # The architecture actually trained (with --init_from it is the checkpoint's, not
            # the config's preset); eval_main.py rebuilds the model from it.
            "model_config": {"type": type(model_cfg).__name__, **dataclasses.asdict(model_cfg)},
            "init_from": init_from,
        }


def _create_model(model_cfg, strategy, seed: int):
    from flax import nnx

    from zoo import create_model

    return create_model(model_cfg, strategy, rngs=nnx.Rngs(seed))


def _from_pretrained(path: str, strategy, model_section):
    try:
        from zoo import from_pretrained
    except ImportError:
        raise ValueError(
            "--init_from needs zoo.from_pretrained, which this checkout does not have yet"
        ) from None
    if not os.path.isdir(path):
        raise FileNotFoundError(f"--init_from={path!r} is not a directory")
    # The checkpoint fixes the architecture; the config still chooses how it runs.
    runtime = dict(
        dtype=model_section.dtype,
        scan_layers=model_section.scan_layers,
        remat=model_section.remat,
        attention_impl=model_section.attention_impl,
    )
    return from_pretrained(path, strategy, **runtime)


def train(setup: Setup) -> list[dict]:
    """Run the loop for a built `Setup`: resume if the workdir has a checkpoint, train, log,
    evaluate, save. Returns the logged records (training steps and evaluations)."""
    import jax

    from training.loop import LoopOptions
    from training.loop import run as run_loop
    from training.metrics import MetricsWriter

    run, workdir, trainer = setup.run, setup.workdir, setup.trainer
    is_main = jax.process_index() == 0
    if is_main:
        os.makedirs(workdir, exist_ok=True)
        with open(os.path.join(workdir, "run_info.json"), "w") as f:
            json.dump(setup.run_info, f, indent=2)
    _say(
        f"{setup.model_cfg.describe()}\nstrategy {setup.strategy.name} on mesh "
        f"{dict(setup.mesh.shape)} ({jax.device_count()} devices, {jax.process_count()} "
        f"processes); batch {run.data.global_batch_size}x{run.data.seq_len}, "
        f"{run.optimizer.micro_batches} micro-batches; workdir {workdir}"
    )
    with jax.set_mesh(setup.mesh):
        ckpt, watcher = _make_checkpointer(run, workdir, setup.run_info)
        start_step = 0
        latest = ckpt.latest_step() if ckpt is not None else None
        if latest is not None:
            ckpt.restore(
                latest, model=setup.model, optimizer=setup.optimizer, data_iter=setup.train_iter
            )
            trainer.reload()
            start_step = latest
            _say(f"resumed from step {latest}")
        writer = MetricsWriter(
            workdir,
            is_main,
            run.training.steps,
            resume_step=latest,
            progress_bar=run.logging.progress_bar,
        )
        try:
            batches = setup.train_batches
            if start_step < run.training.steps:
                first = next(batches)
                seconds = trainer.compile(first)
                _say(f"compiled the train step in {seconds:.1f}s {trainer.compiled_cost()}")
                batches = itertools.chain([first], batches)
            options = LoopOptions(
                total_steps=run.training.steps,
                tokens_per_step=run.data.global_batch_size * run.data.seq_len,
                flops_per_token=setup.flops_per_token,
                peak_flops=setup.peak_per_device * jax.device_count(),
                log_every=run.logging.log_every,
                eval_every=run.training.eval_every,
                checkpoint_every=run.checkpoint.every if ckpt is not None else 0,
                seed=run.training.seed,
            )
            records = run_loop(
                trainer,
                options,
                train_batches=batches,
                make_val_batches=setup.make_val_batches,
                learning_rate=lambda s: setup.schedule(s),
                writer=writer,
                checkpointer=ckpt,
                train_iter=setup.train_iter,
                watcher=watcher,
                start_step=start_step,
            )
        finally:
            writer.finalize()
            if ckpt is not None:
                ckpt.close()
            if watcher is not None:
                watcher.close()
    losses = [r["loss"] for r in records if "loss" in r]
    vals = [r["val_loss"] for r in records if "val_loss" in r]
    if losses:
        _say(
            f"done: loss {losses[0]:.4f} -> {losses[-1]:.4f}"
            + (f", val_loss {vals[-1]:.4f}" if vals else "")
            + f"; metrics in {os.path.join(workdir, 'metrics.jsonl')}"
        )
    return records


def main(argv):
    if len(argv) > 1:
        _usage_error(f"unexpected arguments {argv[1:]}; flags look like --name=value")
    if not flags.FLAGS["verbosity"].present:
        # Orbax logs every save at INFO; keep stderr for the progress bar and errors.
        logging.set_verbosity(logging.WARNING)
    from training import distributed

    # Every mistake in what the user gave surfaces while building (before the first step) as
    # one of these; anything raised later is a bug and keeps its stack trace.
    try:
        distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
        run = _load_config()
        workdir = os.path.abspath(_WORKDIR.value or os.path.join("runs", run.name))
        setup = Setup(run, workdir, init_from=_INIT_FROM.value)
    except (ValueError, FileNotFoundError, NotADirectoryError) as e:
        _usage_error(e)
    train(setup)


if __name__ == "__main__":
    app.run(main, flags_parser=_parse_flags)
