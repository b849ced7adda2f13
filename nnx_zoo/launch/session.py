"""What train_main runs: a built run with its data and its workdir (`prepare`), restored
from the workdir's checkpoint if it has one (`resume`), then trained (`train`).

Every mistake in the inputs surfaces in `prepare` / `resume` as UsageError (one line),
before run_info.json or anything else in the workdir is touched; train_main turns it into
exit status 2.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Callable

import jax

from nnx_zoo.checkpoint.manager import Checkpointer
from nnx_zoo.checkpoint.steps import checkpoint_dir, complete_steps
from nnx_zoo.errors import UsageError
from nnx_zoo.launch import resume as resume_rules
from nnx_zoo.launch.build import Run, build, plan_run
from nnx_zoo.launch.data import RunData, build_data
from nnx_zoo.runtime import host, peers
from nnx_zoo.runtime.console import say, warn
from nnx_zoo.runtime.files import write_json_atomic
from nnx_zoo.runtime.preemption import PreemptionWatcher
from nnx_zoo.training import finetune, flops
from nnx_zoo.training.config import RunConfig
from nnx_zoo.training.loop import LoopOptions
from nnx_zoo.training.loop import run as run_loop
from nnx_zoo.training.metrics import MetricsWriter, WandbWriter, Writers, require_wandb
from nnx_zoo.training.profile import StepProfiler, parse_steps
from nnx_zoo.training.step_memory import step_memory
from zoo.layers.attention import choices as attention_choices

RUN_INFO_FILE = "run_info.json"


@dataclasses.dataclass
class TrainSession:
    built: Run
    data: RunData
    workdir: str
    info: dict  # run_info.json
    notes: list[str]  # printed when training starts
    checkpointer: Checkpointer | None = None
    watcher: PreemptionWatcher | None = None
    start_step: int | None = None  # set by `resume`
    # (step, RunConfig) of the workdir's newest checkpoint, read once by `prepare`; None
    # when there is none (or checkpoints are off).
    saved: tuple[int, RunConfig] | None = None
    # The run's eval.tasks as model -> scores (nnx_zoo/evaluation/in_loop.py), or None.
    downstream: Callable | None = None
    # The line on the learning-rate schedule for the step resumed from (resume.keep_schedule).
    schedule_note: Callable[[int], str | None] | None = None

    @property
    def preempted(self) -> bool:
        """Stopped by a signal before its last step, with that step saved."""
        return getattr(self.watcher, "stopped_at", None) is not None

    @property
    def run(self) -> RunConfig:
        return self.built.config


def prepare(
    run: RunConfig,
    workdir: str,
    *,
    init_from: str | None = None,
    eval_tasks: Callable | None = None,
) -> TrainSession:
    """Mesh, data, model, optimizer and step for `run` in `workdir`. `eval_tasks`: what makes
    the run's in-loop eval tasks, `(run, strategy name, mesh, tokenizer) -> (model -> scores)`
    (nnx_zoo/evaluation/in_loop.py's `make`, which train_main passes: launch may not import
    evaluation); needed when the config sets eval.tasks."""
    if run.eval.tasks and eval_tasks is None:
        raise TypeError("config eval.tasks is set: prepare() needs eval_tasks (in_loop.make)")
    if run.logging.wandb_project:
        require_wandb()  # before anything is built or written
    saved = resume_rules.saved_run(workdir) if run.checkpoint.enabled else None
    schedule_note = None
    if saved is not None:
        run, schedule_note = resume_rules.keep_schedule(run, saved[1])
    finetune.check_lora_run(run, init_from)
    run = finetune.with_data_tokenizer(run, init_from)
    plan = plan_run(run, init_from=init_from)
    # The data before the model: a bad source or tokenizer fails before any initialisation.
    run_data = build_data(run, plan.mesh, plan.strategy.batch_spec())
    downstream = None
    if run.eval.tasks:  # its tasks checked before the model is built
        downstream = eval_tasks(run, plan.strategy.name, plan.mesh, run_data.tokenizer)
    built = build(run, plan=plan, init_from=init_from)
    tokenizer = run_data.tokenizer
    if built.model_cfg.vocab_size < tokenizer.vocab_size:
        fix = (
            "use the checkpoint's own tokenizer (--config.data.tokenizer=<its dir>)"
            if init_from
            else f"set --config.model.vocab_size >= {tokenizer.vocab_size}"
        )
        raise UsageError(
            f"model vocab_size={built.model_cfg.vocab_size} is smaller than the tokenizer's "
            f"{tokenizer.vocab_size} ids ({run.data.tokenizer}); {fix}"
        )
    # What JAX runs the run on (the first line train_main printed): backend, device kind,
    # device and process counts.
    info = {
        **built.info(),
        "platform": host.platform().record(),
        "attention": trace_attention(built),
    }
    return TrainSession(
        built,
        run_data,
        workdir,
        info,
        run_data.notes,
        saved=saved,
        downstream=downstream,
        schedule_note=schedule_note,
    )


def trace_attention(built: Run) -> dict:
    """run_info.json's `attention`: the train step traced (not compiled) while the run is
    built, so an attention backend named in the config that cannot run one of the model's
    calls stops the run here (UsageError), before anything is written; and what `auto`
    chose for each call site, and why. The compile before the first step reuses the trace."""
    with attention_choices.recording() as choices, jax.set_mesh(built.mesh):
        built.trainer.trace(built.abstract_batch())
    return attention_choices.to_json(choices)


def _make_checkpointer(session: TrainSession):
    run = session.run
    if not run.checkpoint.enabled:
        return None, None
    ckpt = Checkpointer(
        session.workdir,
        save_every=run.checkpoint.every,
        keep=run.checkpoint.keep,
        run_info=session.info,
        async_save=run.checkpoint.async_save,
    )
    # With several processes every check is a host all-gather, a sync point: check only at
    # logging steps, where the loop blocks anyway. Alone, a check is free.
    every = 1 if jax.process_count() == 1 else run.logging.log_every
    return ckpt, PreemptionWatcher(check_every=every)


def resume(session: TrainSession) -> int:
    """Restore the newest good checkpoint, if any (after naming each newer one that fails
    its checksums), then record run_info.json. Every mistake in the inputs it finds (a
    checkpoint that does not fit the model, a data position it cannot continue) is a
    UsageError, raised before run_info.json is touched. Returns the step training starts from."""
    run, workdir, built = session.run, session.workdir, session.built
    ckpt, session.watcher = _make_checkpointer(session)
    session.checkpointer = ckpt
    start = ckpt.latest_good_step() if ckpt is not None else None
    if start is not None:
        found = session.saved
        if found is None or found[0] != start:
            # A newer checkpoint failed its checksums and was set aside: this one's record.
            found = resume_rules.saved_run(workdir, start)
        changes = resume_rules.data_changes(run, found[1]) if found is not None else []
        note = resume_rules.check_mixture(run, found[1], start) if found is not None else None
        session.notes += [note] if note and not changes else []
        note = session.schedule_note(start) if session.schedule_note else None
        session.notes += [note] if note else []
        if changes:
            warn(
                f"the data differs from checkpoint step {start}'s ({'; '.join(changes)}): its "
                "iterator state is not restored, the data stream starts from its beginning"
            )
        with jax.set_mesh(built.mesh):
            ckpt.restore(
                start,
                model=built.model,
                optimizer=built.optimizer,
                data_iter=None if changes else session.data.train_iter,
            )
        built.trainer.reload()
    session.start_step = start or 0
    _write_run_info(session)
    return session.start_step


def saved_note(workdir: str, checkpoints: bool) -> Callable[[], str]:
    """What a process stopped by a lost peer says of the saved state (nnx_zoo/runtime/peers.py):
    read when it happens, from the files, since a save may have been cut short."""

    def note() -> str:
        if not checkpoints:
            return "; nothing was saved (checkpoint.enabled=False)"
        steps = complete_steps(checkpoint_dir(workdir), warn=False)
        if not steps:
            return "; no checkpoint was completed"
        return (
            f"; the last complete checkpoint is step {steps[-1]}; start every process again "
            "with the same --workdir to resume from it"
        )

    return note


def _write_run_info(session: TrainSession) -> None:
    if jax.process_index() == 0:
        # Atomically: a run killed here must not leave a half-written record behind.
        write_json_atomic(os.path.join(session.workdir, RUN_INFO_FILE), session.info)


def _announce(session: TrainSession) -> None:
    run, built = session.run, session.built
    say(
        f"{built.model_cfg.describe()}\nstrategy {built.strategy.name} on mesh "
        f"{dict(built.mesh.shape)} ({built.mesh.size} devices, {jax.process_count()} "
        f"processes); batch {run.data.global_batch_size}x{run.data.seq_len}, "
        f"{run.optimizer.micro_batches} micro-batches; workdir {session.workdir}"
    )
    for note in session.notes:
        say(f"note: {note}")
    if session.start_step:
        say(f"resumed from step {session.start_step}")
    if session.start_step >= run.training.steps:
        say(
            f"already complete: the checkpoint is at step {session.start_step} of "
            f"{run.training.steps}; nothing to train (raise --config.training.steps to go on)"
        )


def _compile(session: TrainSession, first_batch) -> None:
    """Compile the step ahead of the first one (so no timing includes it) and record its
    memory, the same figures plan_main reports for this command line."""
    trainer = session.built.trainer
    peers.note("while compiling the train step")
    seconds = trainer.compile(first_batch)
    memory = step_memory(trainer.compiled)
    figures = memory.to_json() if memory is not None else {}
    say(f"compiled the train step in {seconds:.1f}s; memory per device {figures}")
    session.info["memory"] = figures
    _write_run_info(session)


def _loop_options(session: TrainSession) -> LoopOptions:
    run, built = session.run, session.built
    peak = flops.peak_flops_per_device(
        jax.devices()[0],
        dtype=built.model_cfg.compute_dtype,
        override_tflops=run.logging.peak_tflops,
    )
    return LoopOptions(
        total_steps=run.training.steps,
        tokens_per_step=run.data.global_batch_size * run.data.seq_len,
        # One formula for model FLOPs: the config's (6 * matmul params + causal attention).
        flops_per_token=built.model_cfg.flops_per_token(run.data.seq_len),
        peak_flops=peak * built.mesh.size,
        precision_peak_ratio=flops.precision_peak_ratio(
            jax.devices()[0], built.model_cfg.quantization
        ),
        log_every=run.logging.log_every,
        eval_every=run.training.eval_every,
        seed=run.training.seed,
        # Every process traces its own devices (one file per host under <workdir>/profile).
        profiler=StepProfiler(
            parse_steps(run.logging.profile_steps), session.workdir, program=_program(built)
        ),
        on_phase=peers.note,
        source_names=session.data.source_names,
        downstream=session.downstream,
        downstream_every=run.eval.every,
    )


def _program(built):
    """() -> the compiled train step's HLO text, or None before it is compiled."""

    def text():
        compiled = built.trainer.compiled
        return compiled.as_text() if compiled is not None else None

    return text


def train(session: TrainSession) -> list[dict]:
    """Run the loop: resume if not yet done, train, log, evaluate, save. Returns the logged
    records (training steps and evaluations)."""
    run, built, workdir = session.run, session.built, session.workdir
    if session.start_step is None:
        resume(session)
    start_step, total = session.start_step, run.training.steps
    _announce(session)
    ckpt, watcher = session.checkpointer, session.watcher
    # Outside the mesh: on CPU the peak is measured with a matmul on one device.
    options = _loop_options(session)
    with jax.set_mesh(built.mesh):
        # One history: lines after the restored step (or all, with nothing restored) were
        # written by a run that did not get to save them.
        writer = MetricsWriter(
            workdir,
            jax.process_index() == 0,
            total,
            resume_step=start_step,
            progress_bar=run.logging.progress_bar,
            tensorboard=run.logging.tensorboard,
            loss_curve=run.logging.loss_curve,
        )
        tracker = None
        try:
            batches = session.data.train_batches
            if start_step < total:
                first = next(batches)
                _compile(session, first)
                batches = itertools.chain([first], batches)
                # After the compile: run_info (the W&B config) then holds the step's memory.
                tracker = _tracker(session)
            records = run_loop(
                built.trainer,
                options,
                train_batches=batches,
                make_val_batches=session.data.make_val_batches,
                learning_rate=lambda s: built.schedule(s),
                writer=Writers(writer, tracker) if tracker is not None else writer,
                checkpointer=ckpt,
                train_iter=session.data.train_iter,
                watcher=watcher,
                start_step=start_step,
            )
        except BaseException:
            if tracker is not None:
                tracker.close(exit_code=1)  # the W&B run marked failed
            raise
        finally:
            session.data.close()
            writer.finalize()
            if tracker is not None:
                tracker.close()
            if ckpt is not None:
                ckpt.close()
            if watcher is not None:
                watcher.close()
    _summarise(session, records)
    return records


def _tracker(session: TrainSession) -> WandbWriter | None:
    """The W&B run of logging.wandb_project (process 0 logs), or None without one."""
    logging = session.run.logging
    if not logging.wandb_project:
        return None
    return WandbWriter(
        session.workdir,
        jax.process_index() == 0,
        project=logging.wandb_project,
        entity=logging.wandb_entity,
        name=logging.wandb_run_name,
        tags=logging.wandb_tag_list(),
        config=session.info,
        resume_step=session.start_step,
    )


def _summarise(session: TrainSession, records: list[dict]) -> None:
    stopped = getattr(session.watcher, "stopped_at", None)
    if stopped is not None:
        say(
            f"stopped early at step {stopped} of {session.run.training.steps} (saved); run "
            "again with the same --workdir to continue"
        )
    losses = [r["loss"] for r in records if "loss" in r]
    vals = [r["val_loss"] for r in records if "val_loss" in r]
    if losses:
        say(
            f"done: loss {losses[0]:.4f} -> {losses[-1]:.4f}"
            + (f", val_loss {vals[-1]:.4f}" if vals else "")
            + f"; metrics in {os.path.join(session.workdir, 'metrics.jsonl')}"
        )
