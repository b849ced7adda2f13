"""The safetensors reader: a malformed file is one line naming the file (and the tensor),
never a struct.error, a MemoryError or a reshape error; eval_main exits 2 with that line."""

from __future__ import annotations

import json
import os
import shutil
import struct

import _entry
import numpy as np
import pytest
from _train_helpers import ROOT
from safetensors.numpy import save_file

from zoo.safetensors_io import SINGLE_FILE, CheckpointReader, SafetensorsFile


def _one_line_error(path, match):
    with pytest.raises(ValueError, match=match) as info:
        SafetensorsFile(str(path))
    assert "\n" not in str(info.value) and str(path) in str(info.value)


def _good_file(tmp_path):
    path = tmp_path / "good.safetensors"
    save_file(
        {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(48, np.float32)}, path
    )
    return path


def test_a_good_file_reads_back(tmp_path):
    f = SafetensorsFile(str(_good_file(tmp_path)))
    assert f.shape("a") == (2, 3) and f.dtype("b") == "F32"
    np.testing.assert_array_equal(f.read("a"), np.arange(6, dtype=np.float32).reshape(2, 3))


def test_three_byte_file(tmp_path):
    path = tmp_path / "tiny.safetensors"
    path.write_bytes(b"abc")
    _one_line_error(path, r"3 bytes is too short for a safetensors file")


def test_absurd_header_length_is_checked_against_the_file_size(tmp_path):
    path = tmp_path / "absurd.safetensors"
    path.write_bytes(struct.pack("<Q", 2**62) + b"{}")
    _one_line_error(path, r"header length 4611686018427387904 is larger than the file \(10 bytes\)")


def test_header_that_is_not_json(tmp_path):
    path = tmp_path / "garbled.safetensors"
    path.write_bytes(struct.pack("<Q", 4) + b"\xd9{[x")
    _one_line_error(path, r"the safetensors header is not JSON")


def test_truncated_tensor_names_the_tensor_and_the_file(tmp_path):
    path = _good_file(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[:-100])  # cuts into `b`, the last tensor (192 bytes)
    _one_line_error(path, r"tensor b ends at data byte 216, past the file's 116 bytes of data")


def test_index_naming_a_missing_shard(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}})
    )
    with pytest.raises(ValueError, match=r"lists model-00001-of-00002.safetensors, which does"):
        CheckpointReader(str(tmp_path))


def test_eval_main_exits_2_on_a_three_byte_safetensors_file(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copy(os.path.join(ROOT, "tests", "hf_reference", "gpt2", "config.json"), ckpt)
    (ckpt / SINGLE_FILE).write_bytes(b"abc")
    args = [f"--workdir={tmp_path}", f"--hf_checkpoint={ckpt}", "--sharding_strategy=dp"]
    result = _entry.evaluate([*args, "--tokenizer=byte"])
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if "safetensors" in line]
    assert len(lines) == 1 and "too short for a safetensors file" in lines[0], result.stderr
    assert "Traceback" not in result.stderr
