"""Time the product's train step (launch.build, as train_main builds it) for a zoo config on a
mesh: compile seconds and the median step, on a synthetic batch of one document per row.
Shared by bench/core_step.py and bench/moe_throughput.py."""

from __future__ import annotations

import time

import jax
import numpy as np

from nnx_zoo.launch.build import model_run


def time_train_step(
    model_cfg, strategy_name: str, mesh, *, batch_size: int, seq_len: int, steps: int
) -> tuple[float, float]:
    """(compile seconds, median step seconds after one warm-up step)."""
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
