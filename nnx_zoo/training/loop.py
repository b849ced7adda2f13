"""The train step, the eval step and the loop around them.

The live training state is one pytree, `nnx.state((model, optimizer))`, that a jitted step
takes and returns with its input buffers donated (so parameters and Adam moments are updated
in place). The `model` / `optimizer` objects are brought up to date from it (`Trainer.sync`)
only where something needs them: a checkpoint save, and the end of training.

Nothing here knows a model family: a model is anything with
`model.nll_sum(tokens_BT, segment_ids=..., positions=..., loss_mask_BT=..., chunk_size=...,
packed=...) -> (summed NLL over the counted positions, their count, MoE routing statistics or
None for a dense model)`: the LM head fused with the loss over chunks of `chunk_size` tokens
per device (0: full logits). Under a pipeline strategy the steps take the run's
`PipelinePlan` (`ModelPlan.pipeline`), and `zoo.pipelined` runs the model's layer stack by
its schedule (under 1F1B, the sum whose gradient the pipeline computes in its own loop).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

from nnx_zoo.training import preference
from nnx_zoo.training.optim import accumulate_gradients
from nnx_zoo.training.router_loss import objective_from_sums
from zoo import pipelined

Batch = Mapping[str, jax.Array]

# A mixture's batches carry each row's source index [B] under this key
# (nnx_zoo/data/mixture.py's SOURCE_IDS): the loop counts tokens per source from it, and the
# steps never see it, so a mixture compiles the same step as a single source.
SOURCE_IDS = "source_ids"


def model_batch(batch: Batch) -> Batch:
    """`batch` without the keys that are not the model's input (a mixture's source ids)."""
    return {k: v for k, v in batch.items() if k != SOURCE_IDS} if SOURCE_IDS in batch else batch


@functools.partial(jax.jit, static_argnums=2)
def tokens_per_source(segment_ids_BT, source_ids_B, num_sources: int):
    """[num_sources] int32: the non-padding tokens of the batch that each source gave."""
    tokens_B = jnp.sum(segment_ids_BT != 0, axis=1, dtype=jnp.int32)
    of_source_BS = source_ids_B[:, None] == jnp.arange(num_sources, dtype=source_ids_B.dtype)
    return jnp.sum(jnp.where(of_source_BS, tokens_B[:, None], 0), axis=0)


class DivergedError(FloatingPointError):
    """The loss or the gradient norm stopped being finite. Raised before that step's state is
    saved, so every checkpoint in the workdir holds finite parameters."""

    def __init__(self, step: int, what: str, saved_step: int | None):
        self.step, self.saved_step = step, saved_step
        kept = "nothing was saved" if saved_step is None else f"the last save is step {saved_step}"
        super().__init__(f"training diverged: {what} at step {step}; {kept}")


def _nll_sum(model, batch: Batch, packed: bool, chunk_size: int, pipeline=None):
    # Chat / instruction data (`loss_mask`): only the trained targets (answers, completions)
    # count. The loss is then the mean over those tokens of the whole global batch: sums and
    # counts add over micro-batches and devices before the one division.
    return pipelined.nll_sum(
        model,
        pipeline,
        batch["tokens"],
        segment_ids=batch["segment_ids"],
        positions=batch["positions"],
        loss_mask_BT=batch.get("loss_mask"),
        chunk_size=chunk_size,
        packed=packed,
    )


def loss_sum(
    model, batch: Batch, packed: bool = True, chunk_size: int = 0, pipeline=None
) -> tuple[jax.Array, jax.Array]:
    """(summed next-token NLL over counted tokens, their count): the form gradient accumulation
    needs (sums add across micro-batches; means would not). `packed=False` states that each
    row is one document from index 0, then padding (attention then needs no document mask).
    `pipeline`: the model's `PipelinePlan` under a pipeline strategy (None: none)."""
    out = _nll_sum(model, batch, packed, chunk_size, pipeline)
    return out.total, out.count


def train_loss_sum(
    model,
    batch: Batch,
    packed: bool = True,
    chunk_size: int = 0,
    pipeline=None,
    mtp_loss_weight: float = 0.0,
):
    """(the objective summed over counted tokens, (their count, metric sums)).

    The objective is the NLL plus, for an MoE model, its load-balancing loss weighted by
    the config's `router_aux_loss_coef` (see `objective_from_sums`), plus, with multi-token
    prediction (DeepSeek-V3's model.mtp_depth), `mtp_loss_weight` x the mean over depths of
    each depth's mean NLL, added once per counted token as the aux loss is; `mtp_loss` (that
    mean) joins the metric sums.
    """
    out = _nll_sum(model, batch, packed, chunk_size, pipeline)
    coef = model.cfg.router_aux_loss_coef if out.router_stats is not None else 0.0
    total, (count, sums) = objective_from_sums(out.total, out.count, out.router_stats, coef)
    if out.mtp is not None:
        mtp_loss = out.mtp.mean()
        total = total + mtp_loss_weight * mtp_loss * count
        sums = {**sums, "mtp_loss": mtp_loss * count}
    return total, (count, sums)


def objective_from_nll(nll_BT, mask_BT, moe, aux_coef: float):
    """`objective_from_sums` from the per-token NLL and which positions count."""
    return objective_from_sums(jnp.sum(nll_BT), jnp.sum(mask_BT), moe, aux_coef)


def _loss_and_grad(
    model,
    batch: Batch,
    packed: bool = True,
    chunk_size: int = 0,
    wrt=nnx.Param,
    pipeline=None,
    objective=None,
    reference=None,
    mtp_loss_weight: float = 0.0,
):
    """Gradients of the variables of kind `wrt` (nnx.Param; LoRA adapters: LoraParam).
    `objective`: a preference objective (training/preference.py), None for the NLL."""
    if objective is None:
        grad_fn = nnx.value_and_grad(train_loss_sum, argnums=nnx.DiffState(0, wrt), has_aux=True)
        return grad_fn(model, batch, packed, chunk_size, pipeline, mtp_loss_weight)
    loss_fn = functools.partial(preference.loss_sum, objective, reference=reference)
    grad_fn = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, wrt), has_aux=True)
    return grad_fn(model, batch, packed, chunk_size, pipeline)


class Trainer:
    """Owns the training state and the compiled steps.

    Args:
      model, optimizer: built under the run's mesh (`nnx.Optimizer(model, tx, wrt=nnx.Param)`).
      micro_batches: k; each step accumulates gradients over k slices of its batch.
      batch_spec: the batch arrays' layout, so micro-batches keep rows on their devices.
      packed: whether batch rows may hold several documents (the data pipeline packs them);
        False states one document per row from index 0, then padding.
      loss_chunk_size: tokens per device per chunk of the fused LM head + loss (train and
        eval steps); 0 builds the full logits.
      wrt: the variable kind that trains, as the optimizer's `wrt` (LoRA: LoraParam).
      pipeline: the model's `PipelinePlan` under a pipeline strategy (`ModelPlan.pipeline`);
        None without one.
      objective: a preference objective (`training.preference.Objective`) on batches of
        pairs, None for the next-token loss; the loss is then a mean over pairs, and
        `loss_tokens` counts pairs.
      reference: DPO's frozen reference (`training.preference.frozen_copy`: graphdef and
        state), a step argument beside the state and never donated; None with LoRA (the
        adapters zeroed) or without DPO.
    """

    def __init__(
        self,
        model,
        optimizer,
        *,
        micro_batches: int = 1,
        batch_spec: P | None = None,
        packed: bool = True,
        loss_chunk_size: int = 0,
        wrt=nnx.Param,
        pipeline=None,
        objective=None,
        reference=None,
        moe_bias_update_rate: float = 0.0,
        mtp_loss_weight: float = 0.0,
    ):
        self.model, self.optimizer = model, optimizer
        self.moe_bias_update_rate = moe_bias_update_rate
        self.mtp_loss_weight = mtp_loss_weight
        self.objective = objective
        self.ref_graphdef, self.ref_state = reference if reference is not None else (None, None)
        self.pipeline = pipeline
        self.wrt = wrt
        self.packed = packed
        self.loss_chunk_size = loss_chunk_size
        self.micro_batches = micro_batches
        self.batch_spec = batch_spec
        self.graphdef, self.state = nnx.split((model, optimizer))
        self._train_jit = jax.jit(self._train_step, donate_argnums=0)
        self._eval_jit = jax.jit(self._eval_step)
        self.compiled = None  # the train step compiled ahead of time (`compile`)
        self.compile_seconds: float | None = None

    # -- the steps ----------------------------------------------------------------------

    def _reference(self, ref_state):
        return None if ref_state is None else (self.ref_graphdef, ref_state)

    def _train_step(self, state, batch: Batch, ref_state=None):
        model, optimizer = nnx.merge(self.graphdef, state)
        loss, num_tokens, grads, means = accumulate_gradients(
            functools.partial(
                _loss_and_grad,
                packed=self.packed,
                chunk_size=self.loss_chunk_size,
                wrt=self.wrt,
                pipeline=self.pipeline,
                objective=self.objective,
                reference=self._reference(ref_state),
                mtp_loss_weight=self.mtp_loss_weight,
            ),
            model,
            batch,
            self.micro_batches,
            batch_spec=self.batch_spec,
        )
        # Named for profiles and bench/step_breakdown.py.
        with jax.named_scope("optimizer"):
            grad_norm = optax.tree.norm(grads)  # before clipping: what the data asked for
            optimizer.update(model, grads)
        layer_load = means.pop("moe_layer_load", None)
        if layer_load is not None:
            # The routers' correction bias (DeepSeek-V3), after the gradient step; None for a
            # mixture without one.
            bias_LE = model.balance_routing(layer_load, self.moe_bias_update_rate)
            if bias_LE is not None:
                means["moe_router_bias"] = jnp.mean(bias_LE, axis=0)
        metrics = {"loss": loss, "grad_norm": grad_norm, "loss_tokens": num_tokens, **means}
        return nnx.state((model, optimizer)), metrics

    def _eval_step(self, state, batch: Batch, ref_state=None):
        model, _ = nnx.merge(self.graphdef, state)
        # Dropout (LoRA's, the one model part that has any) only while training.
        model = nnx.view(model, deterministic=True, raise_if_not_found=False)
        if self.objective is not None:  # the objective's mean over the held-out pairs
            total, (count, _) = preference.loss_sum(
                self.objective,
                model,
                batch,
                self.packed,
                self.loss_chunk_size,
                self.pipeline,
                self._reference(ref_state),
                router_aux=False,
            )
            return total, count
        return loss_sum(model, batch, self.packed, self.loss_chunk_size, self.pipeline)

    def compile(self, batch: Batch) -> float:
        """Compile the train step ahead of time for batches like `batch`; returns seconds.

        Separate from the first step so step timings (tokens/s, MFU) never include it.
        """
        start = time.perf_counter()
        self.compiled = self.lower(model_batch(batch)).compile()
        self.compile_seconds = time.perf_counter() - start
        return self.compile_seconds

    def lower(self, batch: Batch, *, train: bool = True):
        """The train (or eval) step lowered for the current state's and `batch`'s types; with
        abstract state (ShapeDtypeStructs on a target's mesh) this compiles for hardware not
        present."""
        step = self._train_jit if train else self._eval_jit
        return step.lower(self.state, model_batch(batch), self.ref_state)

    def trace(self, batch: Batch):
        """The train step traced (not lowered) for the current state's and `batch`'s types:
        the model's Python runs, so what it checks at trace time fails here; jax keeps the
        trace, which `lower` / `compile` for the same types then reuse."""
        return self._train_jit.trace(self.state, model_batch(batch), self.ref_state)

    def train_step(self, batch: Batch) -> dict[str, jax.Array]:
        """One optimizer step; returns its metrics as (not yet fetched) device scalars."""
        step_fn = self.compiled or self._train_jit
        self.state, metrics = step_fn(self.state, model_batch(batch), self.ref_state)
        return metrics

    def eval_step(self, batch: Batch) -> tuple[jax.Array, jax.Array]:
        return self._eval_jit(self.state, model_batch(batch), self.ref_state)

    # -- the objects ----------------------------------------------------------------------

    def sync(self):
        """Point `model` / `optimizer` at the current state (after steps donated the old
        buffers); returns them."""
        nnx.update((self.model, self.optimizer), self.state)
        return self.model, self.optimizer

    def reload(self) -> None:
        """Take the state from `model` / `optimizer` after something changed them in place
        (a checkpoint restore)."""
        self.state = nnx.state((self.model, self.optimizer))


def evaluate(trainer: Trainer, batches: Iterator[Batch]) -> tuple[float, int]:
    """Token-weighted mean validation loss over `batches` (global arrays), and the token count."""
    total, count = 0.0, 0
    for batch in batches:
        nll, n = trainer.eval_step(batch)
        total += float(nll)
        count += int(n)
    return (total / count if count else math.nan), count


@dataclasses.dataclass
class LoopOptions:
    total_steps: int
    tokens_per_step: int  # global batch * seq_len (padding included: the compute done)
    flops_per_token: float  # model FLOPs per token for training (config.flops_per_token)
    peak_flops: float  # all devices together, in the compute dtype (bf16 on accelerators)
    # Peak at model.quantization's precision over `peak_flops` (2 for fp8 on H100, int8 on
    # TPU v5/v6; 1 without quantization or a faster path): `mfu_at_precision`'s divisor.
    precision_peak_ratio: float = 1.0
    log_every: int = 10
    eval_every: int = 0  # 0: only at the end
    seed: int = 0
    profiler: Any = None  # training.profile.StepProfiler, or None
    # Told what the loop does next ("during step 7", "while saving step 20"): what a process
    # whose peer was lost says it was doing (nnx_zoo/runtime/peers.py).
    on_phase: Callable[[str], None] | None = None
    # data.mixture's source names, in the order of the batches' source ids: each training
    # line gets `tokens/<name>`, the non-padding tokens of that source in the steps it covers.
    source_names: tuple[str, ...] = ()
    # In-loop eval tasks (config `eval`): model -> scores, run every `downstream_every` steps
    # (0: only at the end) on the model as it stands; their time is left out of the step
    # timings, as validation's is, and logged as `lm_eval/eval_time`.
    downstream: Callable[[Any], Mapping[str, float]] | None = None
    downstream_every: int = 0


def _fetch(metrics: dict[str, jax.Array]) -> dict:
    """The step's metrics on the host, once every local device has finished the step.
    `device_get` reads one device's copy; waiting for all of them makes a device whose part
    failed (a collective with a lost process) raise here, before anything else is dispatched:
    otherwise that device would start the next program's collectives (the preemption
    all-gather) against messages the lost process sent for this one, and gloo aborts the
    process on the mismatch, before it can report the loss in one line."""
    return jax.device_get(jax.block_until_ready(metrics))


class _Loop:
    """The state of one pass of `run`: the step, the interval being timed, the last save."""

    def __init__(self, trainer, options, writer, checkpointer, train_iter, start_step):
        self.trainer, self.options, self.writer = trainer, options, writer
        self.checkpointer, self.train_iter = checkpointer, train_iter
        self.start_step = self.step = start_step
        self.tokens_seen = start_step * options.tokens_per_step
        self.interval_start, self.interval_steps = time.perf_counter(), 0
        self.metrics: dict[str, jax.Array] = {}
        self.saved_step = start_step or None  # resumed: the workdir holds that step
        self.records: list[dict[str, Any]] = []
        # The step-time breakdown of each logged interval: seconds waiting for the next batch,
        # and seconds blocked saving a checkpoint (outside the timed interval, as validation).
        self.data_wait = self.checkpoint_wait = 0.0
        # Per step of the interval being logged: [sources] device counts, fetched at the log.
        self.source_tokens: list[jax.Array] = []

    def phase(self, text: str) -> None:
        if self.options.on_phase is not None:
            self.options.on_phase(text)

    def check_finite(self, fetched) -> None:
        # A finite loss with a non-finite gradient norm still writes NaN into the parameters.
        for name in ("loss", "grad_norm"):
            value = float(fetched[name])
            if not math.isfinite(value):
                raise DivergedError(self.step, f"{name} is {value}", self.saved_step)

    def next_batch(self, batches: Iterator[Batch]) -> Batch:
        waited = time.perf_counter()
        batch = next(batches)
        self.data_wait += time.perf_counter() - waited
        return batch

    def train_step(self, batch: Batch) -> None:
        self.phase(f"during step {self.step + 1}")
        profiler = self.options.profiler
        if profiler is not None:
            profiler.before(self.step + 1)
        if self.options.source_names and SOURCE_IDS in batch:
            self.source_tokens.append(
                tokens_per_source(
                    batch["segment_ids"], batch[SOURCE_IDS], len(self.options.source_names)
                )
            )
        self.metrics = self.trainer.train_step(batch)
        self.step += 1
        if profiler is not None:
            profiler.after(self.step, self.metrics)
        self.interval_steps += 1
        self.tokens_seen += self.options.tokens_per_step

    def log(self, learning_rate: Callable[[int], float]) -> None:
        """Fetch the step's metrics (blocks: the interval's steps are done) and write them."""
        o = self.options
        fetched = _fetch(self.metrics)
        elapsed = time.perf_counter() - self.interval_start
        tokens_per_second = self.interval_steps * o.tokens_per_step / elapsed
        record = {
            "loss": float(fetched["loss"]),
            "learning_rate": float(learning_rate(self.step - 1)),  # the rate this step used
            "grad_norm": float(fetched["grad_norm"]),
            "tokens_per_second": tokens_per_second,
            # Against the compute dtype's peak (bf16: the published convention), and against
            # the peak of the precision the projections run in (model.quantization).
            "mfu": tokens_per_second * o.flops_per_token / o.peak_flops,
            "mfu_at_precision": tokens_per_second
            * o.flops_per_token
            / (o.peak_flops * o.precision_peak_ratio),
            "step_time": elapsed / self.interval_steps,
            # step_time = data_wait_time + compute_time (dispatch and device, per step);
            # checkpoint_time: seconds the loop blocked saving since the last record.
            "data_wait_time": self.data_wait / self.interval_steps,
            "compute_time": (elapsed - self.data_wait) / self.interval_steps,
            "checkpoint_time": self.checkpoint_wait,
            "loss_tokens": int(fetched["loss_tokens"]),
            "tokens_seen": self.tokens_seen,
        }
        # MoE: the load-balancing loss, and each expert's share of the routed tokens.
        if "aux_loss" in fetched:
            record["aux_loss"] = float(fetched["aux_loss"])
            record["expert_load"] = [round(float(x), 5) for x in fetched["expert_load"]]
            record["moe_load_spread"] = float(fetched["moe_load_spread"])
            record["moe_dropped"] = float(fetched["moe_dropped"])
        if "mtp_loss" in fetched:  # multi-token prediction: mean over depths of their NLL
            record["mtp_loss"] = float(fetched["mtp_loss"])
        if "moe_router_bias" in fetched:  # each expert's correction bias, mean over layers
            record["moe_router_bias"] = [round(float(x), 5) for x in fetched["moe_router_bias"]]
        # Preference objectives: TRL's names (rewards/chosen, logps/rejected, ...) and ORPO's
        # terms, each a mean over the step's pairs.
        for name in (*preference.METRICS, "nll_loss", "log_odds_ratio", "log_odds_chosen"):
            if name in fetched:
                record[name] = float(fetched[name])
        if self.source_tokens:
            # int64 on the host: the interval's sum can pass int32's range on a large run.
            counts = np.sum(np.asarray(jax.device_get(self.source_tokens), np.int64), axis=0)
            for name, count in zip(o.source_names, counts, strict=True):
                record[f"tokens/{name}"] = int(count)
            self.source_tokens = []
        self.writer.write(self.step, record)
        self.data_wait = self.checkpoint_wait = 0.0
        self.records.append({"step": self.step, **record})
        self.check_finite(record)

    def save(self, force: bool) -> None:
        o, step = self.options, self.step
        if self.checkpointer is None:
            return
        if not force and not self.checkpointer.due(step):
            return  # the checkpointer would skip it; do not sync the objects for nothing
        started = time.perf_counter()
        if self.metrics:  # a step between log steps may have diverged: never save its state
            self.check_finite(_fetch(self.metrics))
        self.phase(f"while saving step {step}")
        model, optimizer = self.trainer.sync()
        meta = {"step": step, "seed": o.seed, "tokens_seen": self.tokens_seen}
        if self.checkpointer.save(
            step,
            model=model,
            optimizer=optimizer,
            data_iter=self.train_iter,
            meta=meta,
            force=force,
        ):
            self.saved_step = step
            # An object store's metrics.jsonl is written whole, here: the lines up to a
            # checkpoint are kept once it is (nnx_zoo/training/metrics.py).
            self.writer.flush()
        self.checkpoint_wait += time.perf_counter() - started

    def validate(self, make_val_batches) -> None:
        if make_val_batches is None:
            return
        self.phase(f"while evaluating at step {self.step}")
        val_loss, val_tokens = evaluate(self.trainer, make_val_batches())
        self.writer.write_eval(self.step, val_loss, val_tokens=val_tokens)
        self.records.append({"step": self.step, "val_loss": val_loss, "val_tokens": val_tokens})
        # The guard covers evaluation too: NaN over counted tokens is a diverged model (no
        # counted token at all cannot happen: sources hold no empty documents).
        if val_tokens and not math.isfinite(val_loss):
            raise DivergedError(self.step, f"val_loss is {val_loss}", self.saved_step)

    def run_downstream(self) -> None:
        run_tasks = self.options.downstream
        if run_tasks is None:
            return
        self.phase(f"while running eval tasks at step {self.step}")
        started = time.perf_counter()
        model, _ = self.trainer.sync()  # the live parameters: no copy
        scores = {**run_tasks(model), "lm_eval/eval_time": time.perf_counter() - started}
        self.writer.write_scores(self.step, scores)
        self.records.append({"step": self.step, **scores})

    def restart_interval(self, logged: bool, paused: float) -> None:
        # Validation and saving sit outside the timed intervals.
        if logged:
            self.interval_start, self.interval_steps = time.perf_counter(), 0
        else:
            self.interval_start += time.perf_counter() - paused


def run(
    trainer: Trainer,
    options: LoopOptions,
    *,
    train_batches: Iterator[Batch],
    make_val_batches: Callable[[], Iterator[Batch]] | None,
    learning_rate: Callable[[int], float],
    writer,
    checkpointer=None,
    train_iter=None,
    watcher=None,
    start_step: int = 0,
) -> list[dict[str, Any]]:
    """Train from `start_step` to `options.total_steps`; returns the logged records.

    `train_batches` yields global arrays; `train_iter` is the Grain iterator behind it, whose
    state the checkpointer saves. `writer` is a training.metrics.MetricsWriter (or its
    `Writers`: it and a W&B run). The checkpointer (nnx_zoo/checkpoint/manager.py: it alone
    decides which steps are due) and the preemption watcher (nnx_zoo/runtime/preemption.py)
    may each be None; without a checkpointer nothing is saved.
    """
    loop = _Loop(trainer, options, writer, checkpointer, train_iter, start_step)
    total = options.total_steps
    preempted = False
    while loop.step < total:
        loop.train_step(loop.next_batch(train_batches))
        step, last = loop.step, loop.step == total
        # The first step of a run is logged too, so the curve starts at the untrained loss.
        log_now = step % options.log_every == 0 or last or step == start_step + 1
        if log_now:
            loop.log(learning_rate)
        paused = time.perf_counter()
        if options.eval_every and step % options.eval_every == 0 and not last:
            loop.validate(make_val_batches)
        every = options.downstream_every
        if every and step % every == 0 and not last:
            loop.run_downstream()
        loop.save(force=False)
        if watcher is not None and not last and watcher.should_stop(step):
            loop.save(force=True)
            preempted = True
            break
        loop.restart_interval(log_now, paused)
    if options.profiler is not None:
        options.profiler.stop(loop.metrics)  # a range past the last step ends with the run
    if not preempted and loop.step > start_step:
        loop.validate(make_val_batches)
        loop.run_downstream()
        loop.save(force=True)
    if checkpointer is not None:
        checkpointer.wait()
    trainer.sync()
    return loop.records
