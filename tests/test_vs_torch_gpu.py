"""bench/vs_torch_gpu.py runs tiny on a CPU, so the script a GPU session runs cannot rot between
GPU runs: its JAX child (the train step as train_main builds it) and its transformers +
PyTorch child both finish, and the table prints both rows and the ratio. The bench's own
process is the subject (it starts its children as a GPU session would), so it runs as one."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

# The peer's row needs them (CI's floor leg installs them; the newest leg runs no peer).
pytest.importorskip("torch", reason="the PyTorch peer needs torch (extra [hf])")
pytest.importorskip("transformers", reason="the PyTorch peer is transformers' Llama (extra [hf])")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_tiny_on_cpu_prints_both_rows_and_the_ratio(tmp_path):
    trace = tmp_path / "torch_trace.json"
    command = [
        sys.executable,
        "-m",
        "bench.vs_torch_gpu",
        "--config=tiny",
        "--device=cpu",
        "--steps=1",
        "--warmup=1",
        "--batch=4",
        "--seq=64",
        "--no_fp8",  # its own row; the fp8 step compiles in tests/test_quantization.py
        f"--torch_trace={trace}",
    ]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {line.split()[0]: line for line in result.stdout.splitlines() if line.strip()}
    for run in ("jax", "torch"):
        assert re.match(rf"{run}\s+256\s+[\d.]+\s+[\d,]+\s+[\d.]+%", rows[run]), result.stdout
    assert "eager" in rows["torch"]  # torch.compile is off on a CPU, and the table says so
    assert re.search(r"ratio: jax \(bf16 step\) / torch = [\d.]+x", result.stdout), result.stdout

    # The torch trace the GPU session breaks down with bench/step_breakdown.py.
    from bench.step_breakdown import torch_breakdown

    breakdown = torch_breakdown(str(trace))
    for category in ("gemm", "lm_head_loss", "optimizer"):
        assert breakdown[category]["seconds"] > 0, (category, breakdown)
