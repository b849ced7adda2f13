"""Start-up on a host without an accelerator must work with or without the [gpu] extra."""

import importlib.util
import os
import sys

from nnx_zoo.runtime import host


def test_quiet_import_works_without_the_cuda_plugin_package(monkeypatch):
    # A base install (`pip install -e .`) has no `jax_plugins` package at all: find_spec of a
    # submodule then raises instead of returning None.
    def no_plugins(name, *args):
        raise ModuleNotFoundError(f"No module named {name.split('.')[0]!r}")

    monkeypatch.setattr(host, "has_nvidia_gpu", lambda: False)
    monkeypatch.setattr(host, "has_tpu", lambda: False)
    monkeypatch.setattr(importlib.util, "find_spec", no_plugins)
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    stderr_before = os.fstat(2)
    host.import_jax_quietly()
    # No accelerator: the CPU platform, so libtpu does not probe for chips; and stderr, which
    # the native libraries were kept off, is the same file again.
    assert os.environ["JAX_PLATFORMS"] == "cpu"
    assert "jax" in sys.modules
    after = os.fstat(2)
    assert (after.st_dev, after.st_ino) == (stderr_before.st_dev, stderr_before.st_ino)
