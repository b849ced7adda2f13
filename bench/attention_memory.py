"""Per-device temp memory of one train step, xla attention against the flash paths, from
compiles for chips this host does not have (extras [tpu], [gpu]).

    python -m bench.attention_memory [--configs=small,llama3_8b] [--seq_lens=2048,8192]
        [--targets=v5p:2x2x2,h100:8] [--batch_per_device=1]

For each config, sequence length and target: the product's train step (training.Trainer),
bf16, fsdp_tp on the target's 8 devices (4 x 2), packed rows, compiled with `xla` and with
the target's flash backend (splash on TPU, cuDNN with the document mask on GPU). Prints one
line each: temp bytes per device (activations and workspace; arguments are the same for both)
and the attention kernels in the HLO. Compile figures, not timings. llama3.1-8b compiles take
minutes each for TPU on a small host.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import time

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the targets are compiled for, not used

from nnx_zoo.launch.build import abstract_run  # noqa: E402
from nnx_zoo.planning import target_devices, target_platform  # noqa: E402
from nnx_zoo.training.config import RunConfig  # noqa: E402
from shardings import get_strategy  # noqa: E402

FLASH = {"tpu": "splash", "gpu": "cudnn"}
GIB = 2**30


def _model_config(name: str, seq_len: int, impl: str):
    module = importlib.import_module(f"configs.{name}")
    run = RunConfig.from_config_dict(module.get_config())
    cfg = run.model.decoder_config()
    import dataclasses

    return dataclasses.replace(
        cfg,
        dtype="bfloat16",
        attention_impl=impl,
        remat="full",
        max_seq_len=max(cfg.max_seq_len, seq_len),
    )


def _kernels(hlo: str) -> str:
    calls = set(re.findall(r'custom_call_target="(__cudnn\$fmha\w*)"', hlo))
    calls |= {k for k in re.findall(r"%(splash_mha_\w+?)(?:\.\d+)? = ", hlo)}
    return ",".join(sorted(calls)) or "-"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", default="small,llama3_8b")
    parser.add_argument("--seq_lens", default="2048,8192")
    parser.add_argument("--targets", default="v5p:2x2x2,h100:8")
    parser.add_argument("--batch_per_device", type=int, default=1)
    args = parser.parse_args()
    strategy = get_strategy("fsdp_tp")
    for name in args.configs.split(","):
        for seq_len in map(int, args.seq_lens.split(",")):
            for target in args.targets.split(","):
                devices = target_devices(target)
                for impl in ("xla", FLASH[target_platform(target)]):
                    cfg = _model_config(name, seq_len, impl)
                    mesh = strategy.make_mesh(shape=(4, 2), devices=devices, config=cfg)
                    start = time.perf_counter()
                    compiled, _ = abstract_run(
                        cfg,
                        strategy.name,
                        mesh,
                        batch_size=args.batch_per_device * len(devices),
                        seq_len=seq_len,
                    ).compile()
                    memory = compiled.memory_analysis()
                    print(
                        f"{name} T={seq_len} {target} {impl}: temp "
                        f"{memory.temp_size_in_bytes / GIB:.2f} GiB/device, arguments "
                        f"{memory.argument_size_in_bytes / GIB:.2f} GiB, kernels "
                        f"{_kernels(compiled.as_text())} "
                        f"(compiled in {time.perf_counter() - start:.0f} s)",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
