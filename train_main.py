"""Train a language model: flags -> config -> mesh -> model -> loop.

    python train_main.py --config=configs/tiny.py --sharding_strategy=fsdp_tp --workdir=DIR \
        [--config.optimizer.learning_rate=1e-3] [--mesh_shape=data:4,model:2]

Writes DIR/metrics.jsonl, DIR/run_info.json, DIR/tensorboard/, DIR/loss_curve.png and
DIR/checkpoints/ (process 0 writes the files; every process takes part in checkpoints). Run
again with the same workdir and it resumes from the latest checkpoint. A bad flag, strategy,
mesh, data path or config ends with exit status 2 and one line on stderr.
"""

from __future__ import annotations

import os
import sys

from launch import cli

cli.preamble()

from absl import flags  # noqa: E402

RUN = cli.define_run_flags(" | auto (the fastest that fits, planning/)")
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory; default ./runs/<config name>.")
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


def main(argv):
    cli.no_arguments(argv)
    cli.quiet_logging()
    from runtime import peers

    try:
        _train()
    except BaseException as e:
        # Several processes: leave without JAX's exit barrier, which would wait for peers
        # that leave the same way (runtime/peers.py). Alone: as Python would.
        peers.exit_after(e)
        raise
    peers.done()


def _train():
    import dataclasses

    from checkpoint import write_errors
    from checkpoint.workdir import expand, hold
    from launch import session
    from runtime import distributed, peers
    from training.loop import DivergedError

    # Every mistake in what the user gave surfaces while building (before the first step) as
    # one of these; anything raised later is a bug and keeps its stack trace.
    try:
        # The config first: its peer timeout goes to jax.distributed.initialize.
        notes = []
        run = cli.load_run_config(RUN, notes=notes)
        timeout = run.training.peer_timeout_seconds
        distributed.initialize(
            _COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value, peer_timeout_s=timeout
        )
        cli.warn(notes)
        coordinator = _COORDINATOR.value.rsplit(":", 1)[0] if _COORDINATOR.value else None
        watch = peers.start(timeout, coordinator)
        if _PEAK_TFLOPS.value is not None:
            logging = dataclasses.replace(run.logging, peak_tflops=_PEAK_TFLOPS.value)
            run = dataclasses.replace(run, logging=logging)
        if run.training.sharding_strategy == "auto":
            from planning.cli import resolve_auto

            run = resolve_auto(run)  # compiles candidates on these devices; picks, says why
        workdir = expand(_WORKDIR.value or os.path.join("runs", run.name))
        if watch is not None:
            watch.describe = session.saved_note(workdir, run.checkpoint.enabled)
        # Checked writable (checkpoints/ too), no history to overwrite, held until exit.
        lock = hold(workdir, checkpoints=run.checkpoint.enabled)
        init_from = expand(_INIT_FROM.value) if _INIT_FROM.value else None
        prepared = session.prepare(run, workdir, init_from=init_from)
        session.resume(prepared)
    except (ValueError, FileNotFoundError, NotADirectoryError) as e:
        peers.leave()
        cli.usage_error(cli.device_hint(e))
    try:
        session.train(prepared)
    except DivergedError as e:
        peers.leave()
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
        peers.leave()
        print(f"error: {failure}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        if lock is not None:
            lock.release()  # an orderly stop: the next run finds no stale lock
        # Not sys.exit: the exit handlers of the metrics writers would flush onto the same
        # full disk and print their own tracebacks. The kernel drops the workdir lock.
        os._exit(1)


if __name__ == "__main__":
    cli.run_main(main)
