"""Tests for nnx_zoo/training/metrics.py and nnx_zoo/training/flops.py."""

import json
import os
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nnx_zoo.training import flops
from nnx_zoo.training.metrics import MetricsWriter, read_metrics

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TRAIN_KEYS = {"step", "loss", "learning_rate", "grad_norm", "tokens_per_second", "mfu"}


def _train_metrics(step):
    return {
        "loss": jnp.float32(5.0 - 0.1 * step),  # a jax scalar, as the loop will pass
        "learning_rate": np.float32(1e-3),
        "grad_norm": 1.5,
        "tokens_per_second": 1234.5,
        "mfu": 0.25,
    }


def _read_lines(path):
    with open(path) as f:
        text = f.read()
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


def test_writes_jsonl_tensorboard_and_png(tmp_path):
    workdir = str(tmp_path / "run")
    writer = MetricsWriter(workdir, is_main_process=True, total_steps=10)
    for step in range(1, 7):
        writer.write(step, _train_metrics(step))
        if step % 3 == 0:
            writer.write_eval(step, val_loss=jnp.float32(4.0 - 0.1 * step), perplexity=50.0)
    writer.write(7, {**_train_metrics(7), "grad_norm": float("nan")})
    writer.finalize()

    lines = _read_lines(os.path.join(workdir, "metrics.jsonl"))
    train = [r for r in lines if "loss" in r]
    val = [r for r in lines if "val_loss" in r]
    assert [r["step"] for r in train] == list(range(1, 8))
    assert all(set(r) == TRAIN_KEYS for r in train)
    assert train[1]["loss"] == pytest.approx(4.8)
    assert train[-1]["grad_norm"] is None  # NaN written as null: strict JSON
    assert [(r["step"], set(r)) for r in val] == [(3, {"step", "val_loss", "perplexity"})] + [
        (6, {"step", "val_loss", "perplexity"})
    ]
    assert val[0]["val_loss"] == pytest.approx(3.7)

    events = os.listdir(os.path.join(workdir, "tensorboard"))
    assert any(name.startswith("events.out.tfevents") for name in events)
    assert sum(os.path.getsize(os.path.join(workdir, "tensorboard", n)) for n in events) > 100

    with open(os.path.join(workdir, "loss_curve.png"), "rb") as f:
        png = f.read()
    assert png.startswith(PNG_SIGNATURE) and len(png) > 1000
    assert not [n for n in os.listdir(workdir) if n.startswith(".tmp-")]  # no temp left behind


def _read_scalars(tensorboard_dir):
    """tag -> [(step, value)] from the event files (TFRecord framing: u64 length, u32 crc,
    payload, u32 crc), parsed with tensorboardX's own protos (tensorboard is not installed)."""
    from tensorboardX.proto import event_pb2

    scalars = {}
    for name in sorted(os.listdir(tensorboard_dir)):
        with open(os.path.join(tensorboard_dir, name), "rb") as f:
            data = f.read()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset : offset + 8])
            event = event_pb2.Event.FromString(data[offset + 12 : offset + 12 + length])
            offset += 12 + length + 4
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def test_tensorboard_holds_the_scalars(tmp_path):
    writer = MetricsWriter(str(tmp_path), is_main_process=True, total_steps=3, progress_bar=False)
    for step in (1, 2):
        writer.write(step, _train_metrics(step))
    writer.write_eval(2, val_loss=3.5)
    writer.close()
    scalars = _read_scalars(str(tmp_path / "tensorboard"))
    assert [(s, round(v, 4)) for s, v in scalars["train/loss"]] == [(1, 4.9), (2, 4.8)]
    assert scalars["train/mfu"] == [(1, 0.25), (2, 0.25)]
    assert scalars["eval/loss"] == [(2, 3.5)]


def test_truncate_after_and_resume(tmp_path):
    workdir = str(tmp_path)
    writer = MetricsWriter(workdir, is_main_process=True, total_steps=10, progress_bar=False)
    for step in range(1, 9):
        writer.write(step, _train_metrics(step))
    writer.write_eval(4, val_loss=3.0)
    writer.truncate_after(5)  # on the open writer: it keeps appending to the new file
    writer.write(6, _train_metrics(6))
    writer.close()
    path = os.path.join(workdir, "metrics.jsonl")
    assert [r["step"] for r in _read_lines(path)] == [1, 2, 3, 4, 5, 4, 6]

    # A crash mid-line, then a resume from a checkpoint at step 3.
    with open(path, "a") as f:
        f.write('{"step": 7, "lo')
    writer = MetricsWriter(
        workdir, is_main_process=True, total_steps=10, resume_step=3, progress_bar=False
    )
    writer.write(4, _train_metrics(4))
    writer.close()
    assert [r["step"] for r in _read_lines(path)] == [1, 2, 3, 4]


def test_restart_from_step_0_keeps_one_history(tmp_path):
    # A run that crashed before its first checkpoint (or ran without checkpoints) is started
    # again on its workdir: launch.session passes resume_step=0, and the old lines go.
    workdir = str(tmp_path)
    for _ in range(2):
        writer = MetricsWriter(
            workdir, is_main_process=True, total_steps=3, resume_step=0, progress_bar=False
        )
        for step in range(1, 4):
            writer.write(step, _train_metrics(step))
        writer.close()
    assert [r["step"] for r in _read_lines(os.path.join(workdir, "metrics.jsonl"))] == [1, 2, 3]


def test_files_follow_the_umask(tmp_path):
    from nnx_zoo.runtime.files import write_json_atomic

    previous = os.umask(0o027)
    try:
        import importlib

        from nnx_zoo.runtime import files

        importlib.reload(files)  # it reads the umask once
        files.write_json_atomic(str(tmp_path / "a.json"), {})
    finally:
        os.umask(previous)
        importlib.reload(files)
    assert oct(os.stat(tmp_path / "a.json").st_mode & 0o777) == oct(0o640)
    write_json_atomic(str(tmp_path / "b.json"), {})
    assert oct(os.stat(tmp_path / "b.json").st_mode & 0o777) == oct(0o666 & ~previous)


def test_partial_last_line_is_dropped_when_appending(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    writer = MetricsWriter(str(tmp_path), is_main_process=True, total_steps=5, progress_bar=False)
    writer.write(2, {"loss": 1.0})
    writer.close()
    assert _read_lines(path) == [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.0}]
    assert read_metrics(str(path))[-1] == {"step": 2, "loss": 1.0}


def test_non_main_process_writes_nothing(tmp_path):
    workdir = tmp_path / "run"
    writer = MetricsWriter(str(workdir), is_main_process=False, total_steps=5)
    writer.write(1, _train_metrics(1))
    writer.write_eval(1, val_loss=2.0)
    writer.truncate_after(0)
    writer.finalize()
    assert not workdir.exists()


def test_tensorboard_and_loss_curve_can_be_turned_off(tmp_path):
    # logging.tensorboard / logging.loss_curve: metrics.jsonl alone, and it is complete.
    workdir = tmp_path / "run"
    writer = MetricsWriter(
        str(workdir), is_main_process=True, total_steps=2, tensorboard=False, loss_curve=False
    )
    writer.write(1, _train_metrics(1))
    writer.write_eval(1, val_loss=2.0)
    writer.finalize()
    assert sorted(os.listdir(workdir)) == ["metrics.jsonl"]
    assert [r["step"] for r in read_metrics(str(workdir / "metrics.jsonl"))] == [1, 1]


# --- FLOPs and MFU -----------------------------------------------------------------------


def _hand_config(**overrides):
    from zoo.layers.config import DecoderConfig

    base = dict(
        num_layers=2,
        hidden_dim=8,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
        ffn_dim=16,
        vocab_size=10,
    )
    return DecoderConfig(**{**base, **overrides})


def test_flops_per_token_hand_count():
    # Per layer: q 8*2*4=64, k 8*1*4=32, v 32, o 2*4*8=64 -> 192; GLU MLP 3*8*16=384.
    # Two layers 2*576=1152, LM head 8*10=80: N_matmul = 1232; 6 * 1232 = 7392.
    # Causal attention, T=6: keys per query 1..6, mean 3.5; 12 * N*D * L * 3.5 = 672.
    cfg = _hand_config()
    assert cfg.matmul_params() == 1232
    assert cfg.flops_per_token(6) == 7392 + 672
    # Without GLU the MLP has 2 matrices: 2 layers * 128 fewer entries, times 6.
    assert _hand_config(glu=False).flops_per_token(6) == 7392 - 6 * 256 + 672


def test_flops_sliding_window():
    from zoo.layers.config import causal_keys_per_query

    # T=8, w=4: queries see 1, 2, 3, 4, 4, 4, 4, 4 keys, mean 26/8 = 3.25 (4.5 with no window).
    assert causal_keys_per_query(8, 4) == 3.25
    assert causal_keys_per_query(8) == 4.5
    base = _hand_config().flops_per_token(8)
    windowed = _hand_config(sliding_window=4).flops_per_token(8)
    assert base - windowed == 12 * 2 * 4 * 2 * (4.5 - 3.25)
    assert _hand_config(sliding_window=8).flops_per_token(8) == base
    assert _hand_config(sliding_window=100).flops_per_token(8) == base
    # Interleaved layers: one local, one global is half-way between.
    mixed = _hand_config(sliding_window=4, global_every=2).flops_per_token(8)
    assert mixed == (base + windowed) / 2


def test_keys_per_query_matches_a_mask_count():
    from zoo.layers.config import causal_keys_per_query

    # C against counting the ones of the actual causal (windowed) mask, as the model builds it.
    for t, w in [(7, None), (64, 16), (64, 63), (50, 1)]:
        i, j = np.arange(t)[:, None], np.arange(t)[None, :]
        mask = (j <= i) & ((i - j < w) if w else True)
        assert causal_keys_per_query(t, w) == pytest.approx(mask.sum() / t, rel=1e-12)


@pytest.mark.parametrize(
    "kind,dtype,expected",
    [
        ("NVIDIA H100 80GB HBM3", jnp.bfloat16, 989e12),
        ("NVIDIA H100 PCIe", jnp.bfloat16, 756e12),
        ("NVIDIA H200", jnp.bfloat16, 989e12),
        ("NVIDIA H100 80GB HBM3", jnp.float32, 494.5e12),
        ("NVIDIA A100-SXM4-80GB", jnp.bfloat16, 312e12),
        ("NVIDIA A100-SXM4-40GB", jnp.float32, 156e12),
        ("TPU v4", jnp.bfloat16, 275e12),
        ("TPU v5 lite", jnp.bfloat16, 197e12),
        ("TPU v5e", jnp.bfloat16, 197e12),
        ("TPU v5", jnp.bfloat16, 459e12),
        ("TPU v5p", jnp.float32, 459e12),
        ("TPU v6 lite", jnp.bfloat16, 918e12),
        ("TPU v6e", jnp.bfloat16, 918e12),
        ("Tesla T4", jnp.bfloat16, None),
    ],
)
def test_peak_flops_table(kind, dtype, expected):
    assert flops.lookup_peak_flops(kind, dtype) == expected


class _Device:
    def __init__(self, platform, device_kind):
        self.platform, self.device_kind = platform, device_kind


@pytest.mark.parametrize(
    "kind,quantization,ratio",
    [
        ("NVIDIA H100 80GB HBM3", "fp8", 2.0),
        ("NVIDIA H100 80GB HBM3", "int8", 2.0),
        ("NVIDIA H100 80GB HBM3", "none", 1.0),
        ("NVIDIA A100-SXM4-80GB", "fp8", 1.0),  # no fp8 path: the bf16 rate
        ("TPU v5p", "int8", 2.0),
        ("TPU v6 lite", "fp8", 1.0),
        ("Tesla T4", "int8", 1.0),  # unknown: MFU at precision is MFU
    ],
)
def test_precision_peak_ratio(kind, quantization, ratio):
    # 1979 / 989 on the H100: "2x" to the data sheet's rounding.
    assert flops.precision_peak_ratio(_Device("gpu", kind), quantization) == pytest.approx(
        ratio, rel=1e-3
    )


def test_the_planner_takes_its_chips_peaks_from_the_one_table():
    from nnx_zoo.planning.chips import CHIPS, chip_name_for, peak_flops

    for name, chip in CHIPS.items():
        if chip.platform == "cpu":
            continue
        peak = flops.PEAKS[name]
        for quantization in ("none", "fp8", "int8"):
            assert peak_flops(chip, quantization) == peak.at(quantization), (name, quantization)
        assert chip_name_for(_Device(chip.platform, peak.kinds[0])) == name
    assert chip_name_for(_Device("gpu", "NVIDIA H100 80GB HBM3")) == "h100"
    assert chip_name_for(_Device("tpu", "TPU v5 lite")) == "v5e"
    with pytest.raises(ValueError, match="no figures for device kind"):
        chip_name_for(_Device("gpu", "NVIDIA H100 PCIe"))  # its own peaks, no planner chip


def test_peak_flops_per_device_on_cpu():
    device = jax.devices()[0]
    assert flops.peak_flops_per_device(device, override_tflops=2.5) == 2.5e12
    with pytest.raises(ValueError):
        flops.peak_flops_per_device(device, override_tflops=0)
    measured = flops.peak_flops_per_device(device, jnp.float32)
    # Per device, with 8 simulated devices sharing the host: between 10 MFLOP/s and 10 TFLOP/s.
    assert 1e7 < measured < 1e13
    assert measured == flops.measure_cpu_peak_flops(dtype=jnp.float32)  # cached per process


def test_mfu():
    # 1000 tok/s * 1e9 FLOP/tok = 1e12 FLOP/s over 4 devices of 1e12: 25%.
    assert flops.mfu(1000.0, 1e9, 4, 1e12) == pytest.approx(0.25)
