"""Train a language model: flags -> config -> mesh -> model -> loop.

    python train_main.py --config=configs/tiny.py --sharding_strategy=fsdp_tp --workdir=DIR \
        [--config.optimizer.learning_rate=1e-3] [--mesh_shape=data:4,model:2]

Writes DIR/metrics.jsonl, DIR/run_info.json, DIR/tensorboard/, DIR/loss_curve.png and
DIR/checkpoints/ (process 0 writes the files; every process takes part in checkpoints). Run
again with the same workdir and it resumes from the latest checkpoint. A bad flag, strategy,
mesh, data path or config ends with exit status 2 and one line on stderr.

Exit status: 0 finished; 143 stopped by SIGTERM / SIGINT with the step saved (run again to
resume; docs/cluster.md's requeue rules match it); 2 a mistake in the flags, config or data;
1 a failure (a diverged run, a save that could not be written, a lost peer, a bug).
"""

from __future__ import annotations

import dataclasses
import os
import sys

from nnx_zoo.checkpoint import write_errors  # imports no jax, no Orbax
from nnx_zoo.launch import cli

cli.preamble()

FLAGS = cli.new_flags()
RUN = cli.define_run_flags(FLAGS, " | auto (the fastest that fits, nnx_zoo/planning/)")


@cli.quiet_logging()
@write_errors.failed_saves_said_once()  # until the process leaves (a failed save: os._exit)
def main(argv):
    cli.no_arguments(argv)
    from nnx_zoo.runtime import peers

    try:
        status = _train()
    except BaseException as e:
        # Several processes: leave without JAX's exit barrier, which would wait for peers
        # that leave the same way (nnx_zoo/runtime/peers.py). Alone: as Python would.
        peers.exit_after(e)
        raise
    peers.done()
    if status:
        sys.exit(status)


def _train() -> int:
    """The run; returns its exit status: 0 finished, EXIT_PREEMPTED stopped by a signal and
    saved (a scheduler requeues on it; docs/cluster.md)."""
    # Orbax, Grain and the model load once the flags are good: --help and a bad flag answer
    # without them.
    from nnx_zoo.checkpoint.workdir import expand, hold
    from nnx_zoo.data import DataFileError
    from nnx_zoo.errors import UsageError
    from nnx_zoo.launch import session
    from nnx_zoo.runtime import console, distributed, host, peers
    from nnx_zoo.runtime.preemption import EXIT_PREEMPTED
    from nnx_zoo.training.loop import DivergedError

    lock = None
    # The lock goes when the run does (a run called in-process included); the kernel drops it
    # if the process dies.
    try:
        # Every mistake in what the user gave surfaces while building (before the first step) as
        # one of these; anything raised later is a bug and keeps its stack trace.
        try:
            # The config first: its peer timeout goes to jax.distributed.initialize.
            notes = []
            run = cli.load_run_config(RUN, notes=notes)
            timeout = run.training.peer_timeout_seconds
            address = RUN.coordinator_address.value
            distributed.initialize(
                address, RUN.num_processes.value, RUN.process_id.value, peer_timeout_s=timeout
            )
            host.announce()  # the first line (UsageError: the accelerator asked for is absent)
            for note in notes:  # adjustments a user expects (a smoke run's warmup)
                console.warn(note)
            coordinator = address.rsplit(":", 1)[0] if address else None
            watch = peers.start(timeout, coordinator)
            if RUN.peak_tflops.value is not None:
                logging = dataclasses.replace(run.logging, peak_tflops=RUN.peak_tflops.value)
                run = dataclasses.replace(run, logging=logging)
            init_from = expand(RUN.init_from.value) if RUN.init_from.value else None
            if run.training.sharding_strategy == "auto":
                from nnx_zoo.planning.cli import resolve_auto

                # Compiles candidates of the model it starts from on these devices; says why.
                run = resolve_auto(run, init_from=init_from)
            workdir = expand(RUN.workdir.value or os.path.join("runs", run.name))
            if watch is not None:
                watch.describe = session.saved_note(workdir, run.checkpoint.enabled)
            # Checked writable (checkpoints/ too), no history to overwrite, held until exit.
            lock = hold(workdir, checkpoints=run.checkpoint.enabled)
            eval_tasks = None
            if run.eval.tasks:  # lm-eval tasks inside training (evaluation imports launch)
                from nnx_zoo.evaluation.in_loop import make as eval_tasks
            prepared = session.prepare(run, workdir, init_from=init_from, eval_tasks=eval_tasks)
            session.resume(prepared)
        except UsageError as e:
            peers.leave()
            cli.usage_error(cli.device_hint(e))
        try:
            session.train(prepared)
            return EXIT_PREEMPTED if prepared.preempted else 0
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
        except DataFileError as e:
            # A streamed document read mid-run: the user's data, as at start (exit 2). What was
            # saved and logged before it is complete (session.train closed the writers).
            peers.leave()
            cli.usage_error(
                f"{e}; training stopped there"
                f"{session.saved_note(workdir, run.checkpoint.enabled)()}"
            )
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

    finally:
        if lock is not None:
            lock.release()


def run(argv: list[str] | None = None) -> None:
    """The `zoo-train` console script: the same as `python train_main.py ARGS`."""
    cli.run_main(main, FLAGS, doc=__doc__, argv=argv)


if __name__ == "__main__":
    run()
