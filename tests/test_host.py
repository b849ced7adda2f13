"""The platform is JAX's choice, and said (issue 48, item 2): the first line of a run names the
backend, the device kind and count; run_info.json records them; an accelerator the user asks
for (JAX_PLATFORMS) that JAX does not start is exit 2 in one line."""

from __future__ import annotations

import subprocess
import sys

import jax
import pytest
from _entry import run_main
from _stderr import ours
from _train_helpers import ROOT, TRAIN_MAIN, child_env

from nnx_zoo.errors import UsageError
from nnx_zoo.runtime import host

LINE = f"jax {jax.__version__} on cpu: 8 x cpu devices"


@pytest.mark.parametrize(
    "value, wanted",
    [
        ("", ()),
        ("cpu", ()),
        ("tpu", ("tpu",)),
        ("cuda", ("cuda",)),
        ("GPU", ("gpu",)),
        ("rocm", ("rocm",)),
        ("tpu,cuda", ("tpu", "cuda")),
        # The user lets JAX fall back to the CPU: that is asking for no accelerator.
        ("cuda,cpu", ()),
        ("tpu, cpu", ()),
    ],
)
def test_what_jax_platforms_asks_for(value, wanted):
    assert host.requested_accelerators({"JAX_PLATFORMS": value}) == wanted


def test_the_platform_is_jaxs_and_its_line_names_it():
    # tests/conftest.py: JAX_PLATFORMS=cpu and 8 simulated devices.
    found = host.platform()
    assert found.record() == {
        "jax": jax.__version__,
        "backend": "cpu",
        "device_kind": "cpu",
        "device_count": 8,
        "process_count": 1,
    }
    assert found.line() == LINE
    several = host.Platform("0.10.2", "tpu", "TPU v5p", 16, 4)
    assert several.line() == "jax 0.10.2 on tpu: 16 x TPU v5p devices in 4 processes"
    assert host.Platform("0.10.2", "gpu", "NVIDIA H100 80GB HBM3", 1, 1).line() == (
        "jax 0.10.2 on gpu: 1 x NVIDIA H100 80GB HBM3 device"
    )


def test_an_accelerator_asked_for_and_not_started_is_a_usage_error():
    # JAX runs on the CPU here; a user who named only an accelerator did not ask for that.
    with pytest.raises(
        UsageError,
        match=r"^JAX_PLATFORMS=tpu asks for an accelerator and jax "
        r"started cpu instead; run on a host that has one, or unset",
    ):
        host.platform({"JAX_PLATFORMS": "tpu"})
    assert host.platform({"JAX_PLATFORMS": "cuda,cpu"}).backend == "cpu"


def test_a_run_says_its_platform_first(tmp_path):
    # A run refused at its data still said where it runs, on stdout's first line.
    result = run_main(
        "train_main", [f"--workdir={tmp_path / 'run'}", f"--config.data.source={tmp_path}/no"]
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stdout.splitlines()[0] == LINE


def test_jax_platforms_naming_an_absent_accelerator_exits_2():
    # Before: a host without the chip's device files trained on the CPU without a word (or,
    # with the device files, whatever JAX did). libtpu says why it found no TPU, in its own
    # lines; ours is the one error line, last.
    env = {**child_env(), "JAX_PLATFORMS": "tpu"}
    result = subprocess.run(
        [sys.executable, TRAIN_MAIN, "--workdir=/nonexistent/never-made"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in ours(result.stderr).splitlines() if line.startswith("error:")]
    assert errors == [ours(result.stderr).strip().splitlines()[-1]], result.stderr[-3000:]
    assert errors[0].startswith(
        "error: JAX_PLATFORMS=tpu asks for an accelerator and jax found none ("
    ), errors
    assert "Traceback" not in result.stderr
    assert result.stdout == ""
