"""Checkpoint figures for a run config (default configs/small.py, ~105M parameters):
size on disk, how long `Checkpointer.save` blocks training, the total time of a save, and the
time to restore onto the live model.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \
        python -m bench.checkpoint_bench [--config=configs/small.py] [--strategy=fsdp_tp] \
        [--mesh_shape=data:4,model:2] [--repeats=3] [--workdir=/tmp/ckpt_bench] \
        [--stores=local,gs,s3]

Saves the model and its AdamW state (params + two moments, after one update so they are not
zeros) and a Grain iterator's state, as training does. "blocks" is the wall time of `save()`
(device-to-host copy and scheduling; training could continue after it); "total" runs from the
start of `save()` until `wait()` returns (the bytes and their checksums are on disk);
"checksums" is the part of it a background thread spends on CRC-32s after Orbax's commit, off
the training step. Each figure is printed per repeat; the first repeat includes one-time
set-up. Last, the cost of that thread to a training step: the mean time of a jitted matmul
step, alone and while the checksums of the saved checkpoint are being computed.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import shutil
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import grain  # noqa: E402
import jax  # noqa: E402
from flax import nnx  # noqa: E402

from nnx_zoo.checkpoint import integrity  # noqa: E402
from nnx_zoo.checkpoint.manager import Checkpointer  # noqa: E402
from nnx_zoo.checkpoint.steps import checkpoint_dir  # noqa: E402
from nnx_zoo.launch.build import build  # noqa: E402
from nnx_zoo.training.config import RunConfig  # noqa: E402


def load_run_config(path: str) -> RunConfig:
    spec = importlib.util.spec_from_file_location("bench_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return RunConfig.from_config_dict(module.get_config())


def dir_bytes(path: str) -> int:
    return sum(
        os.path.getsize(os.path.join(root, name))
        for root, _, files in os.walk(path)
        for name in files
    )


def step_time_with_and_without_checksums(step_dir: str, steps: int = 40) -> tuple[float, float]:
    """Mean seconds of a jitted 1024x1024 matmul step: alone, then with a thread writing the
    manifest of `step_dir` over and over (what a save's background thread does once)."""
    import threading

    import jax.numpy as jnp

    x = jnp.ones((1024, 1024), jnp.float32)
    step = jax.jit(lambda a: jnp.tanh(a @ a) * 0.5)
    step(x).block_until_ready()

    def timed() -> float:
        start = time.perf_counter()
        y = x
        for _ in range(steps):
            y = step(y)
        y.block_until_ready()
        return (time.perf_counter() - start) / steps

    alone = min(timed() for _ in range(3))
    stop = threading.Event()

    def checksum_forever():
        while not stop.is_set():
            integrity.write_manifest(step_dir)

    thread = threading.Thread(target=checksum_forever, daemon=True)
    thread.start()
    beside = min(timed() for _ in range(3))
    stop.set()
    thread.join()
    return alone, beside


def compare_stores(args, model, optimizer, it, mesh) -> None:
    """Save (until `wait()` returns: on disk with its checksums) and restore of the same state
    on each store of --stores: local disk, and the S3 / GCS servers the tests use
    (bench/object_stores.py), started here on this host. Best of --repeats."""
    import contextlib
    import tempfile

    from bench import object_stores

    stores = args.stores.split(",")
    with contextlib.ExitStack() as stack:
        if set(stores) - {"local"}:
            logs = stack.enter_context(tempfile.TemporaryDirectory())
            stack.enter_context(object_stores.started(logs))
        for store in stores:
            workdir = (
                os.path.join(args.workdir, "store")
                if store == "local"
                else f"{store}://{object_stores.BUCKET}/bench"
            )
            ckpt = Checkpointer(workdir, save_every=1, keep=1, run_info={})
            saves, restores = [], []
            for step in range(1, args.repeats + 1):
                start = time.perf_counter()
                ckpt.save(step, model=model, optimizer=optimizer, data_iter=it, meta={})
                ckpt.wait()
                saves.append(time.perf_counter() - start)
                start = time.perf_counter()
                with jax.set_mesh(mesh):
                    ckpt.restore(step, model=model, optimizer=optimizer, data_iter=it)
                restores.append(time.perf_counter() - start)
            ckpt.close()
            print(
                f"store {store:5s}: save {min(saves):7.3f} s, restore {min(restores):7.3f} s "
                f"(best of {args.repeats})"
            )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=os.path.join(ROOT, "configs", "small.py"))
    parser.add_argument("--strategy", default="fsdp_tp")
    parser.add_argument("--mesh_shape", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", default="/tmp/ckpt_bench")
    parser.add_argument(
        "--stores",
        default="",
        help="also time save + restore per store: a list of local, gs, s3 (the emulators)",
    )
    args = parser.parse_args()

    run = load_run_config(args.config)
    training = dataclasses.replace(
        run.training,
        sharding_strategy=args.strategy,
        mesh_shape=args.mesh_shape or run.training.mesh_shape,
    )
    run = dataclasses.replace(run, training=training)
    built = build(run)  # the model and optimizer train_main saves
    cfg, model, optimizer, mesh = built.model_cfg, built.model, built.optimizer, built.mesh
    with jax.set_mesh(mesh):
        # One update, so the Adam moments are real numbers (zeros would compress to nothing).
        grads = jax.tree.map(lambda p: 0.01 * p, nnx.state(model, nnx.Param))
        optimizer.update(model, grads)
    it = iter(grain.MapDataset.range(10**6).to_iter_dataset())
    num_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    print(
        f"{cfg.describe()} ({num_params / 1e6:.1f}M arrays), {args.strategy} on "
        f"{dict(mesh.shape)}, {jax.device_count()} {jax.devices()[0].platform} devices"
    )

    shutil.rmtree(args.workdir, ignore_errors=True)
    for mode in ("async", "sync"):
        workdir = os.path.join(args.workdir, mode)
        ckpt = Checkpointer(
            workdir, save_every=1, keep=1, run_info={"bench": True}, async_save=mode == "async"
        )
        for step in range(1, args.repeats + 1):
            start = time.perf_counter()
            ckpt.save(step, model=model, optimizer=optimizer, data_iter=it, meta={"step": step})
            blocked = time.perf_counter() - start
            ckpt.wait()
            total = time.perf_counter() - start
            size = dir_bytes(os.path.join(checkpoint_dir(workdir), str(step)))
            print(
                f"{mode:5s} save {step}: blocks {blocked:7.3f} s, total {total:7.3f} s, "
                f"checksums {ckpt.last_checksum_s:6.3f} s, size {size / 2**20:8.1f} MiB "
                f"({size / num_params:.1f} bytes/param)"
            )
        ckpt.close()

    step_dir = os.path.join(checkpoint_dir(os.path.join(args.workdir, "async")), str(args.repeats))
    start = time.perf_counter()
    assert integrity.verify(step_dir) is None
    print(f"verify all checksums at restore: {time.perf_counter() - start:7.3f} s")
    alone, beside = step_time_with_and_without_checksums(step_dir)
    print(
        f"matmul step: {alone * 1e3:7.2f} ms alone, {beside * 1e3:7.2f} ms while checksumming "
        f"({(beside / alone - 1) * 100:+.1f}%)"
    )

    if args.stores:
        compare_stores(args, model, optimizer, it, mesh)

    ckpt = Checkpointer(os.path.join(args.workdir, "async"), save_every=1, keep=1, run_info={})
    for _ in range(2):
        start = time.perf_counter()
        with jax.set_mesh(mesh):
            ckpt.restore(ckpt.latest_step(), model=model, optimizer=optimizer, data_iter=it)
        print(f"restore (params + optimizer + data): {time.perf_counter() - start:7.3f} s")
    ckpt.close()
    shutil.rmtree(args.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
