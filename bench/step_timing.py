"""Time the product's train step (launch.build, as train_main builds it) for a zoo config on a
mesh: compile seconds and the median step, on a synthetic batch of one document per row.
Shared by bench/core_step.py and bench/moe_throughput.py, with the flags they share
(`define_step_flags`). Nothing here imports jax before a bench's main asks for its devices."""

from __future__ import annotations

import dataclasses
import os
import time


@dataclasses.dataclass(frozen=True)
class StepFlags:
    """absl flag holders: the model, the devices, and the batch and steps timed."""

    model: object
    devices: object
    batch: object
    seq: object
    steps: object


def define_step_flags(*, model: str, model_help: str, devices: int, batch: int) -> StepFlags:
    from absl import flags

    return StepFlags(
        model=flags.DEFINE_string("model", model, model_help),
        devices=flags.DEFINE_integer("devices", devices, "simulated CPU devices"),
        batch=flags.DEFINE_integer("batch", batch, "global batch (rows)"),
        seq=flags.DEFINE_integer("seq", 128, "tokens per row"),
        steps=flags.DEFINE_integer("steps", 10, "timed steps"),
    )


def simulate_cpu_devices(count: int) -> None:
    """Before jax starts: XLA's CPU backend as `count` devices."""
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={count}"
    )


def time_train_step(
    model_cfg, strategy_name: str, mesh, *, batch_size: int, seq_len: int, steps: int
) -> tuple[float, float]:
    """(compile seconds, median step seconds after one warm-up step)."""
    import jax
    import numpy as np

    from nnx_zoo.launch.build import model_run

    run = model_run(model_cfg, strategy_name, mesh, batch_size=batch_size, seq_len=seq_len)
    rng = np.random.default_rng(0)
    shape = (batch_size, seq_len)
    batch = {
        "tokens": rng.integers(0, model_cfg.vocab_size, shape, dtype=np.int32),
        "segment_ids": np.ones(shape, np.int32),
        "positions": np.broadcast_to(np.arange(seq_len, dtype=np.int32), shape),
    }
    sharding = jax.NamedSharding(mesh, run.batch_spec)
    batch = {k: jax.device_put(v, sharding) for k, v in batch.items()}
    with jax.set_mesh(mesh):
        compile_s = run.trainer.compile(batch)
        jax.block_until_ready(run.trainer.train_step(batch))
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            jax.block_until_ready(run.trainer.train_step(batch))
            times.append(time.perf_counter() - start)
    return compile_s, float(np.median(times))
