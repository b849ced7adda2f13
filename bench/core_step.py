"""Compile time and step time of one AdamW train step, per strategy, on simulated devices.

    python -m bench.core_step --model=tiny --strategies=fsdp_tp --batch=16 --seq=128

Prints one line per strategy: compile seconds (lower + compile) and the median of the timed
steps (after one warm-up), in milliseconds, of the train step train_main builds (AdamW, the
training objective, bench/step_timing.py). Figures for the README come from this script.
"""

from __future__ import annotations

import os
import sys

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
        from nnx_zoo.runtime.xla_cpu import set_cpu_flags

        set_cpu_flags()
    import jax

    from bench.step_timing import time_train_step
    from shardings import get_strategy
    from zoo import get_config

    cfg = get_config(_MODEL.value)
    print(f"{cfg.describe()}; batch {_BATCH.value}x{_SEQ.value}; {jax.device_count()} devices")
    for name in _STRATEGIES.value:
        mesh = get_strategy(name).make_mesh(config=cfg)
        compile_s, step_s = time_train_step(
            cfg, name, mesh, batch_size=_BATCH.value, seq_len=_SEQ.value, steps=_STEPS.value
        )
        tokens_per_s = _BATCH.value * _SEQ.value / step_s
        print(
            f"{name:8s} mesh {dict(mesh.shape)}: compile {compile_s:6.2f} s, "
            f"step {1e3 * step_s:8.1f} ms (median of {_STEPS.value}), {tokens_per_s:,.0f} tokens/s"
        )


if __name__ == "__main__":
    app.run(main)
