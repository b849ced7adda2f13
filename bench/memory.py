"""Compiled per-device memory of one train step, for loss chunk sizes x remat policies.

Compiles the real train step (training.loop.Trainer: fused LM head + loss, gradients, AdamW)
on abstract arrays and prints XLA's temp bytes (and peak) per device; nothing runs.

    # CPU (default: V=128256, M=512, 2 layers, one device, batch 2 x 4096)
    python -m bench.memory
    python -m bench.memory --chunk_sizes=0,1024 --remat=none,full --batch_size=1
    # remat under an unrolled layer scan on CPU saves nothing (full: 0.18 GiB rolled, the
    # default under remat; 0.89 GiB unrolled, as much as none): why auto keeps the loop
    python -m bench.memory --num_layers=8 --vocab_size=512 --seq_len=1024 --chunk_sizes=1024 \
        --remat=none,full --scan_unroll=8

    # TPU without the hardware (extra [tpu]): llama3.1-8b at 8192 tokens per chip on 8 v5p
    # chips; with --fit, the largest batch per chip whose peak fits in HBM, per row
    python -m bench.memory --target=v5p:2x2x2 --preset=llama3.1-8b --strategy=fsdp \
        --seq_len=8192 --batch_size=8 --dtype=bfloat16 --chunk_sizes=0,1024 --remat=full --fit
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

_PRESET = flags.DEFINE_string("preset", "tiny", "zoo preset")
_VOCAB = flags.DEFINE_integer("vocab_size", None, "V override; default 128256 with --preset=tiny")
_HIDDEN = flags.DEFINE_integer("hidden_dim", None, "M override; default 512 with --preset=tiny")
_LAYERS = flags.DEFINE_integer("num_layers", None, "L override; default 2 with --preset=tiny")
_DTYPE = flags.DEFINE_string("dtype", "float32", "compute dtype")
_UNROLL = flags.DEFINE_integer(
    "scan_unroll",
    0,
    "layers per scan iteration (0: auto, the model's default)",
)
_STRATEGY = flags.DEFINE_string("strategy", "dp", "sharding strategy")
_MESH = flags.DEFINE_string("mesh_shape", None, "e.g. data:4,model:2; default: the strategy's")
_DEVICES = flags.DEFINE_integer("num_devices", 1, "CPU devices to use (without --target)")
_TARGET = flags.DEFINE_string("target", None, "compile for e.g. v5p:2x2x2 (planning.targets)")
_BATCH = flags.DEFINE_integer("batch_size", 2, "global rows per step")
_SEQ = flags.DEFINE_integer("seq_len", 4096, "tokens per row")
_CHUNKS = flags.DEFINE_list("chunk_sizes", ["0", "512", "1024", "4096"], "loss_chunk_size values")
_REMAT = flags.DEFINE_list(
    "remat", ["none", "full", "dots", "save_qkv_proj", "save_out_proj"], "remat policies"
)
_FIT = flags.DEFINE_boolean(
    "fit", False, "per row, double then bisect the batch to the largest whose peak fits in HBM"
)
_HBM_GIB = flags.DEFINE_float("hbm_gib", None, "device memory for --fit; default by target")

# Per-chip HBM by TPU generation (Cloud TPU documentation), for --fit.
HBM_GIB = {"v5p": 95.0, "v5e": 16.0, "v6e": 32.0}
GIB = 2**30


def _model_config():
    from zoo import get_config

    overrides = dict(dtype=_DTYPE.value, scan_unroll=_UNROLL.value)
    defaults = (
        dict(vocab_size=128_256, hidden_dim=512, num_layers=2) if _PRESET.value == "tiny" else {}
    )
    for name, flag in (("vocab_size", _VOCAB), ("hidden_dim", _HIDDEN), ("num_layers", _LAYERS)):
        value = flag.value if flag.value is not None else defaults.get(name)
        if value is not None:
            overrides[name] = value
    return get_config(_PRESET.value, **overrides)


def _devices():
    import jax

    if _TARGET.value:
        from nnx_zoo.planning.targets import target_devices

        return target_devices(_TARGET.value)
    return jax.devices()[: _DEVICES.value]


def _memory(cfg, strategy, mesh, batch_size, chunk):
    from nnx_zoo.launch.build import abstract_run
    from nnx_zoo.training.step_memory import step_memory

    try:
        run = abstract_run(
            cfg,
            strategy.name,
            mesh,
            batch_size=batch_size,
            seq_len=_SEQ.value,
            loss_chunk_size=chunk,
        )
        return step_memory(run.compile()[0]).to_json()
    except Exception as e:  # an allocation the compiler refuses (TPU: "exceeds HBM")
        return {"error": str(e).strip().splitlines()[0][:120]}


def _fits(memory, hbm_bytes):
    return "peak_bytes" in memory and memory["peak_bytes"] <= hbm_bytes


def _largest_batch(cfg, strategy, mesh, chunk, hbm_bytes, step):
    """Largest multiple of `step` rows whose peak fits, by doubling then bisection."""
    low, high, memory = 0, step, None
    while True:
        m = _memory(cfg, strategy, mesh, high, chunk)
        if not _fits(m, hbm_bytes):
            break
        low, memory, high = high, m, high * 2
    while high - low > step:
        mid = (low + high) // 2 // step * step
        m = _memory(cfg, strategy, mesh, mid, chunk)
        if _fits(m, hbm_bytes):
            low, memory = mid, m
        else:
            high = mid
    return low, memory


def main(argv):
    del argv
    from shardings import get_strategy

    cfg0 = _model_config()
    strategy = get_strategy(_STRATEGY.value)
    devices = _devices()
    mesh = strategy.make_mesh(shape=_MESH.value, devices=devices, config=cfg0)
    platform = devices[0].platform
    print(
        f"{cfg0.describe()} dtype={cfg0.dtype}; {strategy.name} on {dict(mesh.shape)} "
        f"({platform}{', ' + _TARGET.value if _TARGET.value else ''}); "
        f"batch {_BATCH.value} x {_SEQ.value}"
    )
    chunks = [int(c) for c in _CHUNKS.value]
    if _FIT.value:
        generation = (_TARGET.value or "").split(":")[0]
        hbm = (_HBM_GIB.value or HBM_GIB.get(generation) or 0) * GIB
        if not hbm:
            raise app.UsageError("--fit needs --hbm_gib (or a --target with a known HBM size)")
        rows_step = mesh.size  # one row per device at a time: the batch splits evenly
        print(f"largest global batch whose peak fits {hbm / GIB:.1f} GiB per device")
        header = ("remat", 14), ("chunk", 6), ("batch", 6), ("tok/dev", 8), ("temp GiB", 9)
        print(" ".join(f"{name:>{width}}" for name, width in header), f"{'peak GiB':>9}")
        for policy in _REMAT.value:
            cfg = cfg0.replace(remat=policy)
            for chunk in chunks:
                batch, m = _largest_batch(cfg, strategy, mesh, chunk, hbm, rows_step)
                tokens = batch * _SEQ.value // mesh.size
                temp = f"{m['temp_bytes'] / GIB:9.2f}" if m else f"{'-':>9}"
                peak = f"{m['peak_bytes'] / GIB:9.2f}" if m else f"{'-':>9}"
                print(f"{policy:>14} {chunk:>6} {batch:>6} {tokens:>8} {temp} {peak}", flush=True)
        return
    print(f"{'remat':>14} {'chunk':>6} {'temp GiB':>9} {'peak GiB':>9} {'arg GiB':>8}")
    for policy in _REMAT.value:
        cfg = cfg0.replace(remat=policy)
        for chunk in chunks:
            m = _memory(cfg, strategy, mesh, _BATCH.value, chunk)
            if "error" in m:
                print(f"{policy:>14} {chunk:>6} {m['error']}", flush=True)
                continue
            print(
                f"{policy:>14} {chunk:>6} {m['temp_bytes'] / GIB:9.2f} "
                f"{m['peak_bytes'] / GIB:9.2f} {m['argument_bytes'] / GIB:8.2f}",
                flush=True,
            )


if __name__ == "__main__":
    app.run(main)
