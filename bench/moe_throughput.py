"""Training tokens/s of a tiny MoE (dropless) against a dense model of the same active size.

    python bench/moe_throughput.py --model=qwen3-moe-tiny --devices=1 --batch=8 --seq=128

The dense model is the same config with the experts replaced by one MLP of width
k * F_expert, so both do the same matmul FLOPs per token (the router's M x E aside). One
AdamW train step (forward, backward, update) of the training objective; the median of the
timed steps after one warm-up. On XLA's CPU backend ragged_dot runs as a masked matmul over
every expert (zoo/layers/moe.py), so the MoE's cost there grows with E, not k.
"""

from __future__ import annotations

import os
import sys
import time

from absl import app, flags

_MODEL = flags.DEFINE_string("model", "qwen3-moe-tiny", "MoE model preset")
_STRATEGY = flags.DEFINE_string("strategy", "dp", "sharding strategy")
_DEVICES = flags.DEFINE_integer("devices", 1, "simulated CPU devices")
_BATCH = flags.DEFINE_integer("batch", 8, "global batch (rows)")
_SEQ = flags.DEFINE_integer("seq", 128, "tokens per row")
_STEPS = flags.DEFINE_integer("steps", 10, "timed steps")


def main(argv):
    del argv
    if "jax" not in sys.modules:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "")
            + f" --xla_force_host_platform_device_count={_DEVICES.value}"
        )
    import jax
    import numpy as np
    import optax
    from flax import nnx

    from shardings import get_strategy
    from training.loop import train_loss_sum
    from zoo import create_model, get_config

    moe_cfg = get_config(_MODEL.value)
    dense_cfg = moe_cfg.replace(
        num_experts=0, ffn_dim=moe_cfg.num_experts_per_tok * moe_cfg.moe_ffn_dim
    )
    strategy = get_strategy(_STRATEGY.value)
    print(f"batch {_BATCH.value}x{_SEQ.value}; {jax.device_count()} devices; {strategy.name}")
    for label, cfg in (("dense (active size)", dense_cfg), ("moe dropless", moe_cfg)):
        mesh = strategy.make_mesh(config=cfg)
        with jax.set_mesh(mesh):
            model = create_model(cfg, strategy, rngs=nnx.Rngs(0))
            optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
            rng = np.random.default_rng(0)
            shape = (_BATCH.value, _SEQ.value)
            batch = {
                "tokens": rng.integers(0, cfg.vocab_size, shape, dtype=np.int32),
                "segment_ids": np.ones(shape, np.int32),
                "positions": np.broadcast_to(np.arange(_SEQ.value, dtype=np.int32), shape),
            }
            batch = {k: jax.device_put(v, strategy.batch_spec()) for k, v in batch.items()}
            graphdef, state = nnx.split((model, optimizer))

            t0 = time.perf_counter()
            step = jax.jit(_train_step(graphdef, train_loss_sum), donate_argnums=0)
            compiled = step.lower(state, batch).compile()
            compile_s = time.perf_counter() - t0
            state, loss = compiled(state, batch)
            loss.block_until_ready()
            times = []
            for _ in range(_STEPS.value):
                t0 = time.perf_counter()
                state, loss = compiled(state, batch)
                loss.block_until_ready()
                times.append(time.perf_counter() - t0)
        step_s = float(np.median(times))
        print(
            f"{label:20s} {cfg.describe()}\n{'':20s} active FLOPs/token "
            f"{cfg.flops_per_token(_SEQ.value) / 1e6:.2f} M; compile {compile_s:.1f} s; step "
            f"{1e3 * step_s:.1f} ms (median of {_STEPS.value}); "
            f"{_BATCH.value * _SEQ.value / step_s:,.0f} tokens/s"
        )


def _train_step(graphdef, train_loss_sum):
    from flax import nnx

    def step(state, batch):
        model, optimizer = nnx.merge(graphdef, state)

        def loss_fn(model):
            total, (count, _) = train_loss_sum(model, batch)
            return total / count

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    return step


if __name__ == "__main__":
    app.run(main)
