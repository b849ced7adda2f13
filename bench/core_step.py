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

from bench import step_timing
from bench.step_timing import define_step_flags, simulate_cpu_devices, time_train_step

STEP = define_step_flags(model="tiny", model_help="model preset", devices=8, batch=16)
flags.adopt_module_key_flags(step_timing)  # --help lists them with this bench's own
_STRATEGIES = flags.DEFINE_list("strategies", ["dp", "fsdp", "tp", "fsdp_tp"], "strategies")


def main(argv):
    del argv
    if "jax" not in sys.modules:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        simulate_cpu_devices(STEP.devices.value)
        from nnx_zoo.runtime.xla_cpu import set_cpu_flags

        set_cpu_flags()
    import jax

    from shardings import get_strategy
    from zoo import get_config

    batch, seq, steps = STEP.batch.value, STEP.seq.value, STEP.steps.value
    cfg = get_config(STEP.model.value)
    print(f"{cfg.describe()}; batch {batch}x{seq}; {jax.device_count()} devices")
    for name in _STRATEGIES.value:
        mesh = get_strategy(name).make_mesh(config=cfg)
        compile_s, step_s = time_train_step(
            cfg, name, mesh, batch_size=batch, seq_len=seq, steps=steps
        )
        tokens_per_s = batch * seq / step_s
        print(
            f"{name:8s} mesh {dict(mesh.shape)}: compile {compile_s:6.2f} s, "
            f"step {1e3 * step_s:8.1f} ms (median of {steps}), {tokens_per_s:,.0f} tokens/s"
        )


if __name__ == "__main__":
    app.run(main)
