"""Largest sequence length whose train step fits a TPU target, with and without context
parallelism: compiles the product's train step (training.loop.Trainer, AdamW) for the target
without its hardware and reads XLA's per-chip memory.

    ALLOW_MULTIPLE_LIBTPU_LOAD=1 python -m bench.context_fit --model=llama3.2-1b \
        --topology=v5p:4x4x4 --context=8 --seq_lens=8192,16384,32768,65536,131072

`fsdp` puts every chip on `data` (one row per chip); `fsdp_cp` puts `--context` chips on
`context` and the rest on `data` (one row per data shard, split over `context`). bfloat16
compute, full remat, attention_impl=xla. Sequence lengths are tried in increasing order and a
strategy stops at its first that does not fit.
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

_MODEL = flags.DEFINE_string("model", "llama3.2-1b", "model preset")
_TOPOLOGY = flags.DEFINE_string("topology", "v5p:4x4x4", "TPU topology")
_CONTEXT = flags.DEFINE_integer("context", 8, "context axis size for fsdp_cp")
_SEQ_LENS = flags.DEFINE_list("seq_lens", ["8192", "16384", "32768", "65536", "131072"], "T")
_STRATEGIES = flags.DEFINE_list("strategies", ["fsdp", "fsdp_cp"], "fsdp and/or fsdp_cp")
_HBM_GIB = flags.DEFINE_float("hbm_gib", 95.0, "memory per chip (v5p: 95 GiB)")


def _required_bytes(strategy_name, shape, cfg, devices, seq_len) -> int:
    """What must fit per chip (training.step_memory, the planner's formula) for the product's
    step, built by the one assembly (launch.build), one row per data shard."""
    from nnx_zoo.launch.build import abstract_run
    from nnx_zoo.training.step_memory import step_memory
    from shardings import get_strategy

    mesh = get_strategy(strategy_name).make_mesh(shape=shape, devices=devices, config=cfg)
    run = abstract_run(cfg, strategy_name, mesh, batch_size=mesh.shape["data"], seq_len=seq_len)
    return step_memory(run.compile()[0]).required_bytes


def main(argv):
    del argv
    from jax.experimental import topologies

    from zoo import get_config

    topo = topologies.get_topology_desc(topology_name=_TOPOLOGY.value, platform="tpu")
    devices = topo.devices
    n, c = len(devices), _CONTEXT.value
    cfg = get_config(_MODEL.value, dtype="bfloat16", remat="full", attention_impl="xla")
    budget = _HBM_GIB.value * 2**30
    shapes = {"fsdp": (n,), "fsdp_cp": (n // c, c)}
    for name in _STRATEGIES.value:
        shape = shapes[name]
        best = None
        for seq_len in (int(s) for s in _SEQ_LENS.value):
            start = time.perf_counter()
            need = _required_bytes(name, shape, cfg, devices, seq_len)
            fits = need <= budget
            print(
                f"{_MODEL.value} {_TOPOLOGY.value} {name} mesh {shape} rows {shape[0]} "
                f"T={seq_len}: {need / 2**30:.1f} GiB per chip, fits={fits} "
                f"(compiled in {time.perf_counter() - start:.0f}s)",
                flush=True,
            )
            if not fits:
                break
            best = seq_len
        print(f"==> {name}: largest T that fits: {best}", flush=True)


if __name__ == "__main__":
    app.run(main)
