"""Compile time and step time of one AdamW train step, per strategy, on simulated devices.

    python bench/core_step.py --model=tiny --strategies=fsdp_tp --batch=16 --seq=128

Prints one line per strategy: compile seconds (lower + compile) and the median of the timed
steps (after one warm-up), in milliseconds. Figures for the README come from this script.
"""

from __future__ import annotations

import os
import sys
import time

from absl import app, flags

_MODEL = flags.DEFINE_string("model", "tiny", "model preset")
_STRATEGIES = flags.DEFINE_list("strategies", ["dp", "fsdp", "tp", "fsdp_tp"], "strategies")
_DEVICES = flags.DEFINE_integer("devices", 8, "simulated CPU devices")
_BATCH = flags.DEFINE_integer("batch", 16, "global batch (rows)")
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
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from runtime.xla_cpu import set_cpu_flags

        set_cpu_flags()
    import jax
    import numpy as np
    import optax
    from flax import nnx

    from shardings import get_strategy
    from zoo import create_model, get_config
    from zoo.loss import lm_loss

    cfg = get_config(_MODEL.value)
    print(f"{cfg.describe()}; batch {_BATCH.value}x{_SEQ.value}; {jax.device_count()} devices")
    for name in _STRATEGIES.value:
        strategy = get_strategy(name)
        mesh = strategy.make_mesh(config=cfg)
        with jax.set_mesh(mesh):
            model = create_model(cfg, strategy, rngs=nnx.Rngs(0))
            optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
            rng = np.random.default_rng(0)
            tokens = rng.integers(0, cfg.vocab_size, (_BATCH.value, _SEQ.value), dtype=np.int32)
            seg = np.ones_like(tokens)
            pos = np.broadcast_to(np.arange(_SEQ.value, dtype=np.int32), tokens.shape)
            batch = [jax.device_put(x, strategy.batch_spec()) for x in (tokens, seg, pos)]
            graphdef, state = nnx.split((model, optimizer))

            jitted = jax.jit(_train_step(graphdef, lm_loss), donate_argnums=0)
            t0 = time.perf_counter()
            compiled = jitted.lower(state, *batch).compile()
            compile_s = time.perf_counter() - t0
            state, loss = compiled(state, *batch)
            loss.block_until_ready()
            times = []
            for _ in range(_STEPS.value):
                t0 = time.perf_counter()
                state, loss = compiled(state, *batch)
                loss.block_until_ready()
                times.append(time.perf_counter() - t0)
            step_ms = 1e3 * float(np.median(times))
            tokens_per_s = _BATCH.value * _SEQ.value / (step_ms / 1e3)
            print(
                f"{name:8s} mesh {dict(mesh.shape)}: compile {compile_s:6.2f} s, "
                f"step {step_ms:8.1f} ms (median of {_STEPS.value}), {tokens_per_s:,.0f} tokens/s"
            )


def _train_step(graphdef, lm_loss):
    from flax import nnx

    def step(state, tokens, seg, pos):
        model, optimizer = nnx.merge(graphdef, state)

        def loss_fn(model):
            logits = model(tokens, segment_ids=seg, positions=pos)
            return lm_loss(logits, tokens, seg)[0]

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    return step


if __name__ == "__main__":
    app.run(main)
