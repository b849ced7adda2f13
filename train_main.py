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
from ml_collections import config_flags  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_CONFIG = os.path.join(HERE, "configs", "tiny.py")
EXIT_USAGE = 2


def _usage_error(message: str):
    """One line on stderr, exit status 2: for every mistake in what the user gave us."""
    print(f"error: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
    sys.exit(EXIT_USAGE)


def _unknown_field_message(error: Exception) -> str | None:
    """One line for a `--config.<path>` override naming a field the config does not define
    (ml_collections raises a KeyError, sometimes wrapped, whose text spans lines), naming the
    valid fields; None when `error` is something else."""
    import re

    from training.config import SECTIONS, section_fields

    text = str(error).replace("\\'", "'").replace("\\n", "\n")
    quoted = re.search(r"'([A-Za-z_]\w*)'", text)
    if quoted is None:
        return None
    name = quoted.group(1)
    overrides = [a.split("=", 1)[0] for a in sys.argv[1:] if a.startswith("--config.")]
    paths = [o.removeprefix("--config.").split(".") for o in overrides]
    path = next((p for p in paths if name in p), None)
    if path is None:
        return None
    where = path[: path.index(name)]
    if not where:
        valid = ", ".join(("name", *SECTIONS))
    elif where[0] in SECTIONS and len(where) == 1:
        valid = ", ".join(section_fields(where[0]))
    else:
        valid = None
    suggestion = re.search(r'Did you mean "([^"]+)"', text)
    hint = f"; did you mean {suggestion.group(1)!r}?" if suggestion else ""
    section = ".".join(where) or "the config"
    listing = f" (valid in {section}: {valid})" if valid else ""
    return f"--config.{'.'.join(path)}: no such config field {name!r}{hint}{listing}"


def _define_config_flag():
    # config_flags applies `--config.<path>=value` overrides while defining the flag (it reads
    # sys.argv), so a misspelt field raises here, before absl parses anything. It does not
    # expand `~` (the shell does not either, after `=`): every path flag gets it here.
    sys.argv[1:] = [
        f"--config={os.path.expanduser(a.split('=', 1)[1])}" if a.startswith("--config=") else a
        for a in sys.argv[1:]
    ]
    try:
        return config_flags.DEFINE_config_file(
            "config", DEFAULT_CONFIG, "Run config file (a get_config() module).", lock_config=True
        )
    except Exception as e:  # noqa: BLE001 -- a misspelt override, or any error in the file
        _usage_error(_unknown_field_message(e) or _config_file_message(e))


_CONFIG = _define_config_flag()
_STRATEGY = flags.DEFINE_string(
    "sharding_strategy",
    None,
    "a strategy name (shardings.STRATEGIES), or auto (the fastest that fits, planning/); "
    "default: config.training.",
)
_MESH_SHAPE = flags.DEFINE_string(
    "mesh_shape", None, "e.g. data:4,model:2; default: config.training.mesh_shape or the rule."
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory; default ./runs/<config name>.")
_ATTENTION = flags.DEFINE_enum(
    "attention_impl",
    None,
    ["xla", "splash", "cudnn", "auto"],
    "Attention backend (splash: TPU, cudnn: NVIDIA GPU, auto: the platform's); default: config.",
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
    except Exception as e:  # noqa: BLE001 -- the --config file (any error in it) or an override
        _usage_error(_unknown_field_message(e) or _config_file_message(e))


def _config_file_message(error: Exception) -> str:
    """One line for a --config file that did not load (training/config_file.py)."""
    from training.config_file import load_error_message

    given = [a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--config=")]
    return load_error_message(error, given[-1] if given else DEFAULT_CONFIG)


def _load_config():
    """The typed run config, with the command line's choices folded in."""
    import jax

    from training.config import RunConfig

    notes: list[str] = []
    try:
        # config_flags defers a failed load of the file to the first use of the config.
        config = _CONFIG.value
        hasattr(config, "to_dict")  # a file that failed to load raises at the first use
    except Exception as e:  # noqa: BLE001 -- any error in the file: one line, exit 2
        _usage_error(_config_file_message(e))
    run = RunConfig.from_config_dict(config, notes)
    for note in notes:  # adjustments a user expects (a smoke run's warmup), said once
        if jax.process_index() == 0:
            print(f"warning: {note}", file=sys.stderr, flush=True)
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


def main(argv):
    if len(argv) > 1:
        _usage_error(f"unexpected arguments {argv[1:]}; flags look like --name=value")
    if not flags.FLAGS["verbosity"].present:
        # Orbax logs every save at INFO; keep stderr for the progress bar and errors.
        logging.set_verbosity(logging.WARNING)

    from checkpoint.workdir import expand, hold
    from runtime import distributed
    from training.run import Setup, device_hint, train

    # Every mistake in what the user gave surfaces while building (before the first step) as
    # one of these; anything raised later is a bug and keeps its stack trace.
    try:
        distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
        run = _load_config()
        if run.training.sharding_strategy == "auto":
            from planning.cli import resolve_auto

            run = resolve_auto(run)  # compiles candidates on these devices; picks, says why
        workdir = expand(_WORKDIR.value or os.path.join("runs", run.name))
        lock = hold(workdir, checkpoints=run.checkpoint.enabled)  # noqa: F841 -- checked writable, and held until the process exits
        init_from = expand(_INIT_FROM.value) if _INIT_FROM.value else None
        setup = Setup(run, workdir, init_from=init_from)
        setup.resume()
    except (ValueError, FileNotFoundError, NotADirectoryError) as e:
        _usage_error(device_hint(e))
    from checkpoint import write_errors
    from training.loop import DivergedError

    try:
        train(setup)
    except DivergedError as e:
        # Not a mistake in the input (exit 2) nor a bug (a traceback): a run that failed.
        print(
            f"error: {e}; its metrics are in {os.path.join(workdir, 'metrics.jsonl')}; lower "
            "--config.optimizer.learning_rate or raise --config.optimizer.warmup_steps, then "
            "run again (the same --workdir resumes from the last save)",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(1)
    except Exception as e:  # noqa: BLE001 -- a save that could not be written: one line
        failure = write_errors.find(e)
        if failure is None:
            raise
        print(f"error: {failure}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        if lock is not None:
            lock.release()  # an orderly stop: the next run finds no stale lock
        # Not sys.exit: the exit handlers of the metrics writers would flush onto the same
        # full disk and print their own tracebacks. The kernel drops the workdir lock.
        os._exit(1)


if __name__ == "__main__":
    app.run(main, flags_parser=_parse_flags)
