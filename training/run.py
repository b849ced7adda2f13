"""What train_main.py runs: build everything from a typed run config (`Setup`), then train
(`train`). Every mistake in the inputs surfaces while building, as ValueError or
FileNotFoundError, which the entry point turns into exit status 2.

Uses the zoo only through its generic API (create_model, from_pretrained), never a family.
"""

from __future__ import annotations

import dataclasses
import itertools
import os

from checkpoint.files import write_json_atomic


def _say(text: str) -> None:
    import jax

    if jax.process_index() == 0:
        print(text, flush=True)


def device_hint(error: Exception) -> str:
    """The error's text, plus how to simulate devices when a mesh asked for more devices than
    a CPU host has (the usual first stumble on a laptop)."""
    import re

    import jax

    text = str(error)
    wanted = re.search(r"needs (\d+) devices but (\d+) are available", text)
    if wanted and int(wanted.group(1)) > int(wanted.group(2)) and jax.default_backend() == "cpu":
        n = wanted.group(1)
        text += (
            f"; on CPU, simulate {n} devices by starting with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={n}"
        )
    return text


def _make_checkpointer(run, workdir: str, run_info: dict):
    if not run.checkpoint.enabled:
        return None, None
    from checkpoint.manager import Checkpointer

    ckpt = Checkpointer(
        workdir,
        save_every=run.checkpoint.every,
        keep=run.checkpoint.keep,
        run_info=run_info,
        async_save=run.checkpoint.async_save,
    )
    import jax

    from runtime.preemption import PreemptionWatcher

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

        import data
        from data.tokenizers import make_tokenizer
        from runtime.distributed import to_global
        from shardings import check_batch, get_strategy
        from shardings.hybrid import crossing_axes
        from training import flops
        from training.loop import Trainer
        from zoo.layers import remat

        self.workdir = workdir
        self.notes: list[str] = []  # printed when training starts
        if run.checkpoint.enabled:
            from checkpoint import resume

            found = resume.saved_run(workdir)
            if found is not None:
                run, note = resume.keep_schedule(run, found[1])
                self.notes += [note] if note else []
        self.run = run
        strategy = get_strategy(run.training.sharding_strategy)
        model_cfg = run.model.decoder_config()
        mesh = strategy.make_mesh(shape=run.training.mesh_shape or None, config=model_cfg)
        remat.check_platform(model_cfg.remat, mesh.devices.flat[0].platform)
        self.strategy, self.mesh = strategy, mesh
        batch_spec = strategy.batch_spec()
        self.batch_spec = batch_spec
        micro_batch = run.data.global_batch_size // run.optimizer.micro_batches
        check_batch(micro_batch, batch_spec, mesh, strategy.name, seq_len=run.data.seq_len)

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
                model_cfg = model.cfg  # with its vocab padding, if the mesh needs one
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
            tx, self.schedule = run_optimizer(run)
            optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        self.model_cfg, self.model, self.optimizer = model_cfg, model, optimizer
        self.trainer = Trainer(
            model,
            optimizer,
            micro_batches=run.optimizer.micro_batches,
            batch_spec=batch_spec,
            loss_chunk_size=run.training.loss_chunk_size,
        )
        # An attention backend named in the config that cannot run here fails now, in one
        # line, not while the step compiles.
        check_attention(model_cfg, mesh, run.data.seq_len)
        # One formula for model FLOPs: the config's (6 * matmul params + causal attention).
        self.flops_per_token = model_cfg.flops_per_token(run.data.seq_len)
        self.peak_per_device = flops.peak_flops_per_device(
            jax.devices()[0], dtype=model_cfg.compute_dtype, override_tflops=run.logging.peak_tflops
        )
        from planning.chips import precision_peak_ratio

        self.precision_peak_ratio = precision_peak_ratio(jax.devices()[0], model_cfg.quantization)
        self.run_info = {
            "config": run.to_dict(),
            "strategy": strategy.name,
            "mesh_shape": dict(mesh.shape),
            "num_devices": jax.device_count(),
            "num_processes": jax.process_count(),
            # Axes whose collectives leave a slice (or process): the slow links (DCN).
            "slice_crossing_axes": list(crossing_axes(mesh)),
            "model": model_cfg.describe(),
            # The architecture actually trained (with --init_from it is the checkpoint's, not
            # the config's preset); eval_main.py rebuilds the model from it.
            "model_config": {"type": type(model_cfg).__name__, **dataclasses.asdict(model_cfg)},
            "init_from": init_from,
        }
        self.checkpointer = self.watcher = None
        self.start_step: int | None = None  # set by resume()

    def resume(self) -> int:
        """Restore the newest good checkpoint, if any (after naming each newer one that fails
        its checksums), then record run_info.json. Every mistake in the inputs it finds (a
        checkpoint that does not fit the model, a num_workers change) is a ValueError, raised
        before run_info.json is touched. Returns the step training starts from."""
        import jax

        from checkpoint import resume

        run, workdir = self.run, self.workdir
        ckpt, self.watcher = _make_checkpointer(run, workdir, self.run_info)
        self.checkpointer = ckpt
        start = ckpt.latest_good_step() if ckpt is not None else None
        if start is not None:
            found = resume.saved_run(workdir, start)
            changes = resume.data_changes(run, found[1]) if found is not None else []
            if changes:
                _say(
                    f"warning: the data differs from checkpoint step {start}'s "
                    f"({'; '.join(changes)}): its iterator state is not restored, the data "
                    "stream starts from its beginning"
                )
            with jax.set_mesh(self.mesh):
                ckpt.restore(
                    start,
                    model=self.model,
                    optimizer=self.optimizer,
                    data_iter=None if changes else self.train_iter,
                )
            self.trainer.reload()
        self.start_step = start or 0
        if jax.process_index() == 0:
            # Atomically: a run killed here must not leave a half-written record behind.
            write_json_atomic(os.path.join(workdir, "run_info.json"), self.run_info)
        return self.start_step


def run_optimizer(run):
    """(optax transformation, learning-rate schedule) of a run config: the one place the
    optimizer section becomes an optimizer, for training and for the planner alike."""
    from training import optim

    return optim.make_optimizer(
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


def check_attention(model_cfg, mesh, seq_len: int) -> str:
    """The attention backend `model_cfg.attention_impl` runs on `mesh`'s platform for rows of
    `seq_len`; ValueError (one line: why not, what would) when a backend named explicitly
    cannot run there."""
    from zoo.layers.attention_ops import check_implementation

    return check_implementation(
        model_cfg.attention_impl,
        dtype=model_cfg.compute_dtype,
        head_dim=model_cfg.head_dim,
        seq_len=seq_len,
        platform=mesh.devices.flat[0].platform,
        interpret=model_cfg.attention_interpret,
    )


def _create_model(model_cfg, strategy, seed: int):
    from flax import nnx

    from zoo import create_model

    return create_model(model_cfg, strategy, rngs=nnx.Rngs(seed))


def _from_pretrained(path: str, strategy, model_section):
    from zoo import from_pretrained

    if not os.path.isdir(path):
        raise FileNotFoundError(f"--init_from={path!r} is not a directory")
    # The checkpoint fixes the architecture; the config still chooses how it runs.
    runtime = dict(
        dtype=model_section.dtype,
        scan_layers=model_section.scan_layers,
        scan_unroll=model_section.scan_unroll,
        remat=model_section.remat,
        attention_impl=model_section.attention_impl,
        attention_interpret=model_section.attention_interpret,
        quantization=model_section.quantization,
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
    if setup.start_step is None:
        setup.resume()
    start_step, total = setup.start_step, run.training.steps
    ckpt, watcher = setup.checkpointer, setup.watcher
    _say(
        f"{setup.model_cfg.describe()}\nstrategy {setup.strategy.name} on mesh "
        f"{dict(setup.mesh.shape)} ({jax.device_count()} devices, {jax.process_count()} "
        f"processes); batch {run.data.global_batch_size}x{run.data.seq_len}, "
        f"{run.optimizer.micro_batches} micro-batches; workdir {workdir}"
    )
    for note in setup.notes:
        _say(f"note: {note}")
    if start_step:
        _say(f"resumed from step {start_step}")
    if start_step >= total:
        _say(
            f"already complete: the checkpoint is at step {start_step} of {total}; nothing to "
            "train (raise --config.training.steps to go on)"
        )
    with jax.set_mesh(setup.mesh):
        # One history: lines after the restored step (or all, with nothing restored) were
        # written by a run that did not get to save them.
        writer = MetricsWriter(
            workdir,
            is_main,
            total,
            resume_step=start_step,
            progress_bar=run.logging.progress_bar,
        )
        try:
            batches = setup.train_batches
            if start_step < total:
                first = next(batches)
                seconds = trainer.compile(first)
                memory = trainer.compiled_cost()
                _say(f"compiled the train step in {seconds:.1f}s; memory per device {memory}")
                if is_main:
                    setup.run_info["memory"] = memory
                    write_json_atomic(os.path.join(workdir, "run_info.json"), setup.run_info)
                batches = itertools.chain([first], batches)
            options = LoopOptions(
                total_steps=run.training.steps,
                tokens_per_step=run.data.global_batch_size * run.data.seq_len,
                flops_per_token=setup.flops_per_token,
                peak_flops=setup.peak_per_device * jax.device_count(),
                precision_peak_ratio=setup.precision_peak_ratio,
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
            # Worker processes (data.num_workers > 0) hold shared memory until closed.
            setup.train_iter.close()
            writer.finalize()
            if ckpt is not None:
                ckpt.close()
            if watcher is not None:
                watcher.close()
    stopped = getattr(watcher, "stopped_at", None)
    if stopped is not None:
        _say(
            f"stopped early at step {stopped} of {total} (saved); run again with the same "
            "--workdir to continue"
        )
    losses = [r["loss"] for r in records if "loss" in r]
    vals = [r["val_loss"] for r in records if "val_loss" in r]
    if losses:
        _say(
            f"done: loss {losses[0]:.4f} -> {losses[-1]:.4f}"
            + (f", val_loss {vals[-1]:.4f}" if vals else "")
            + f"; metrics in {os.path.join(workdir, 'metrics.jsonl')}"
        )
    return records
