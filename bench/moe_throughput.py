"""Training tokens/s of a tiny MoE (dropless) against a dense model of the same active size.

    python -m bench.moe_throughput --model=qwen3-moe-tiny --devices=1 --batch=8 --seq=128
    python -m bench.moe_throughput --hidden_dim=1024 --num_experts=32 --experts_per_tok=4 \
        --dtype=bfloat16 --platform=gpu        # issue 32's scaled-up model, on one GPU

The dense model is the same config with the experts replaced by one MLP of width
k * F_expert, so both do the same matmul FLOPs per token (the router's M x E aside). One
AdamW train step (forward, backward, update) of the training objective; the median of the
timed steps after one warm-up. On XLA's CPU backend ragged_dot runs as a masked matmul over
every expert (zoo/layers/moe.py), so the MoE's cost there grows with E, not k.
"""

from __future__ import annotations

import os
import sys

from absl import app, flags

from bench import step_timing
from bench.step_timing import define_step_flags, simulate_cpu_devices, time_train_step

STEP = define_step_flags(model="qwen3-moe-tiny", model_help="MoE model preset", devices=1, batch=8)
flags.adopt_module_key_flags(step_timing)  # --help lists them with this bench's own
_STRATEGY = flags.DEFINE_string("strategy", "dp", "sharding strategy")
_HIDDEN = flags.DEFINE_integer("hidden_dim", None, "override M (heads keep their head_dim)")
_EXPERTS = flags.DEFINE_integer("num_experts", None, "override E")
_TOP_K = flags.DEFINE_integer("experts_per_tok", None, "override k")
_EXPERT_FFN = flags.DEFINE_integer("moe_ffn_dim", None, "override one expert's F")
_DTYPE = flags.DEFINE_string("dtype", None, "override the compute dtype (bfloat16 on a GPU)")
_PLATFORM = flags.DEFINE_enum(
    "platform", "cpu", ["cpu", "gpu", "tpu"], "where to run; cpu simulates --devices devices"
)


def main(argv):
    del argv
    if "jax" not in sys.modules:
        # Named, not defaulted: a GPU host's JAX_PLATFORMS would otherwise decide silently.
        os.environ["JAX_PLATFORMS"] = {"gpu": "cuda"}.get(_PLATFORM.value, _PLATFORM.value)
        if _PLATFORM.value == "cpu":
            simulate_cpu_devices(STEP.devices.value)
    import jax

    from shardings import get_strategy
    from zoo import get_config

    batch, seq, steps = STEP.batch.value, STEP.seq.value, STEP.steps.value
    moe_cfg = get_config(STEP.model.value)
    overrides = {
        "hidden_dim": _HIDDEN.value,
        "num_experts": _EXPERTS.value,
        "num_experts_per_tok": _TOP_K.value,
        "moe_ffn_dim": _EXPERT_FFN.value,
        "dtype": _DTYPE.value,
    }
    moe_cfg = moe_cfg.replace(**{k: v for k, v in overrides.items() if v is not None})
    dense_cfg = moe_cfg.replace(
        num_experts=0, ffn_dim=moe_cfg.num_experts_per_tok * moe_cfg.moe_ffn_dim
    )
    strategy = get_strategy(_STRATEGY.value)
    print(f"batch {batch}x{seq}; {jax.device_count()} devices; {strategy.name}")
    for label, cfg in (("dense (active size)", dense_cfg), ("moe dropless", moe_cfg)):
        mesh = strategy.make_mesh(config=cfg)
        compile_s, step_s = time_train_step(
            cfg, strategy.name, mesh, batch_size=batch, seq_len=seq, steps=steps
        )
        print(
            f"{label:20s} {cfg.describe()}\n{'':20s} active FLOPs/token "
            f"{cfg.flops_per_token(seq) / 1e6:.2f} M; compile {compile_s:.1f} s; step "
            f"{1e3 * step_s:.1f} ms (median of {steps}); "
            f"{batch * seq / step_s:,.0f} tokens/s"
        )


if __name__ == "__main__":
    app.run(main)
