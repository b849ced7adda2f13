"""The serving engine's programs (one decode step, one prefill bucket) compiled for a TPU or
GPU target from this host, without the hardware: that they compile, in how long, and the
memory each needs per device (weights, the KV cache it updates in place, temporaries).

    python -m bench.serve_compile --target=h100:1 --config=llama3_1b --max_batch=32 \
        --max_seq_len=2048 --bucket=512
    python -m bench.serve_compile --target=v5p:2x2x1 --config=tiny --strategy=fsdp_tp \
        --mesh_shape=2,2

Targets are nnx_zoo/planning/targets.py's names (extras [tpu] / [gpu]). The model is the
shipped config's, abstract (shapes and layouts only), in its config's dtype.
"""

from __future__ import annotations

import argparse
import importlib
import os
import time


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="h100:1")
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--strategy", default="fsdp_tp")
    parser.add_argument("--mesh_shape", default=None, help="e.g. 2,2; default: the rule's")
    parser.add_argument("--max_batch", type=int, default=8)
    parser.add_argument("--max_seq_len", type=int, default=256)
    parser.add_argument("--bucket", type=int, default=64, help="the prefill length to compile")
    args = parser.parse_args()

    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the target is compiled for, not used
    from nnx_zoo.planning.targets import target_devices
    from nnx_zoo.serving.slots import Slots
    from nnx_zoo.training.config import RunConfig
    from shardings import get_strategy
    from zoo.build import abstract_model

    run = RunConfig.from_config_dict(importlib.import_module(f"configs.{args.config}").get_config())
    cfg = run.model.decoder_config()
    strategy = get_strategy(args.strategy)
    shape = tuple(int(n) for n in args.mesh_shape.split(",")) if args.mesh_shape else None
    mesh = strategy.make_mesh(shape=shape, devices=target_devices(args.target), config=cfg)
    model = abstract_model(cfg, strategy, mesh)
    slots = Slots(model, max_batch=args.max_batch, max_seq_len=args.max_seq_len, mesh=mesh)
    print(
        f"{args.config} ({cfg.dtype}) on {args.target}, {args.strategy} {dict(mesh.shape)}: "
        f"{args.max_batch} slots x {args.max_seq_len} tokens"
    )
    for name, compile_program in (
        ("decode", slots.compile_decode),
        (f"prefill {args.bucket}", lambda: slots.compile_prefill(args.bucket)),
    ):
        start = time.perf_counter()
        memory = compile_program().memory_analysis()
        print(
            f"  {name}: compiled in {time.perf_counter() - start:.1f} s; per device "
            f"arguments {_gib(memory.argument_size_in_bytes)} (the cache updated in place: "
            f"{_gib(memory.alias_size_in_bytes)}), temporaries {_gib(memory.temp_size_in_bytes)}"
        )


def _gib(n: int) -> str:
    return f"{n / 2**30:.3f} GiB"


if __name__ == "__main__":
    main()
