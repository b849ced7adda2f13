"""Dequantization throughput on load: parameters per second on one core for the hub's FP8
(DeepSeek-V3) and MXFP4 (GPT-OSS) tensors, read through zoo/hf_dequantize.py's readers from a
safetensors file (in the page cache after the first pass: the figure is the host's work, not
the disk's).

    taskset -c 0 python -m bench.hf_dequantize            # one core
    taskset -c 0 python -m bench.hf_dequantize --repeats=5

Tensors at the published shapes: a routed expert's gate_proj [2048, 7168] and
kv_a_proj_with_mqa [576, 7168] (FP8, 128x128 blocks, float32 scales); 4 of gpt-oss-20b's 32
experts of one layer's gate_up_proj ([4, 5760, 90, 16] blocks) and down_proj. Each row: the
best of `--repeats` reads, and float32 out.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import tempfile
import time

import ml_dtypes
import numpy as np

from zoo.hf_dequantize import Fp8BlockReader, Mxfp4Reader
from zoo.safetensors_io import CheckpointReader

_ST = {np.dtype(np.float32): "F32", np.dtype(np.uint8): "U8"}
_ST[np.dtype(ml_dtypes.float8_e4m3fn)] = "F8_E4M3"


def _write(path: str, tensors: dict[str, np.ndarray]) -> None:
    header, offset = {}, 0
    for name, x in tensors.items():
        header[name] = {
            "dtype": _ST[x.dtype],
            "shape": list(x.shape),
            "data_offsets": [offset, offset + x.nbytes],
        }
        offset += x.nbytes
    raw = json.dumps(header).encode()
    with open(os.path.join(path, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for x in tensors.values():
            f.write(x.tobytes())


def _fp8(rng, rows, cols):
    q = rng.standard_normal((rows, cols), np.float32).astype(ml_dtypes.float8_e4m3fn)
    return q, rng.uniform(1e-3, 1e-2, (-(-rows // 128), -(-cols // 128))).astype(np.float32)


def _time(reader, name: str, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        reader.read(name)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as d:
        fp8_dir, mx_dir = os.path.join(d, "fp8"), os.path.join(d, "mxfp4")
        os.makedirs(fp8_dir)
        os.makedirs(mx_dir)
        tensors = {}
        for name, shape in (("gate_proj", (2048, 7168)), ("kv_a_proj_with_mqa", (576, 7168))):
            tensors[name + ".weight"], tensors[name + ".weight_scale_inv"] = _fp8(rng, *shape)
        _write(fp8_dir, tensors)
        experts = 4
        mx = {}
        for name, (rows, groups) in (("gate_up_proj", (5760, 90)), ("down_proj", (2880, 90))):
            shape = (experts, rows, groups)
            mx[name + "_blocks"] = rng.integers(0, 256, (*shape, 16), dtype=np.uint8)
            mx[name + "_scales"] = rng.integers(118, 130, shape, dtype=np.uint8)
        _write(mx_dir, mx)
        rows = []
        fp8 = Fp8BlockReader(CheckpointReader(fp8_dir), (128, 128))
        for name in ("gate_proj.weight", "kv_a_proj_with_mqa.weight"):
            rows.append(("fp8", name, fp8.shape(name), _time(fp8, name, args.repeats)))
        mxfp4 = Mxfp4Reader(CheckpointReader(mx_dir))
        for name in ("gate_up_proj", "down_proj"):
            rows.append(("mxfp4", name, mxfp4.shape(name), _time(mxfp4, name, args.repeats)))
        plain = CheckpointReader(fp8_dir)  # the F8 bytes alone: what the file read costs
        read = _time(plain, "gate_proj.weight", args.repeats)
    print(f"cores visible: {len(os.sched_getaffinity(0))}")
    print("| method | tensor | shape (float32 out) | seconds | M params/s |")
    print("|---|---|---|---|---|")
    for method, name, shape, seconds in rows:
        n = int(np.prod(shape))
        print(f"| {method} | {name} | {list(shape)} | {seconds:.4f} | {n / seconds / 1e6:.0f} |")
    print(
        f"| (F8 bytes read alone) | gate_proj.weight | [2048, 7168] | {read:.4f} | "
        f"{2048 * 7168 / read / 1e6:.0f} |"
    )


if __name__ == "__main__":
    main()
