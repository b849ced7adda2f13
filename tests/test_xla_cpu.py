"""The XLA CPU flags the entry points add: only when asked (ZOO_XLA_CPU_FLAGS=1), only where the
running XLA takes them (probed once per jaxlib, the answer cached), after the user's, and XLA
takes ours."""

import json
import os
import subprocess
import sys

import pytest

from nnx_zoo.runtime import xla_cpu
from nnx_zoo.runtime.xla_cpu import CPU_FLAGS, ENABLE_ENV, cpu_flags, set_cpu_flags, xla_takes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OURS = [f"--{name}={value}" for name, value, _ in CPU_FLAGS]
ASKED = {ENABLE_ENV: "1"}


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    """A cache of our own (XDG_CACHE_HOME), so the user's is neither read nor written."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path


def test_flags_are_added_after_the_users(cache_home):
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", **ASKED}
    assert set_cpu_flags(env).split() == ["--xla_force_host_platform_device_count=8", *OURS]
    assert env["XLA_FLAGS"].split()[1:] == OURS


def test_a_flag_the_user_set_is_kept(cache_home):
    name = CPU_FLAGS[0][0]
    flags = cpu_flags(f"--{name}=eltwise")
    assert f"--{name}=eltwise" in flags.split()
    assert not any(f.startswith(f"--{name}=") and f != f"--{name}=eltwise" for f in flags.split())


def test_nothing_is_added_unless_asked(cache_home):
    # Before: every entry point added the experimental flag, unasked.
    for env in ({"XLA_FLAGS": "--a=1"}, {"XLA_FLAGS": "--a=1", ENABLE_ENV: "0"}):
        assert set_cpu_flags(env) == "--a=1" and env["XLA_FLAGS"] == "--a=1"
    env = {}
    assert set_cpu_flags(env) == "" and env == {}
    assert set_cpu_flags(dict(ASKED)) == " ".join(OURS)


def test_a_flag_this_xla_does_not_know_is_not_added(cache_home, monkeypatch):
    # Before: every entry point added the experimental flag, and an XLA that renamed it would
    # abort every command at start-up ("Unknown flag in XLA_FLAGS").
    unknown = ("xla_cpu_no_such_flag_anywhere", "dot", "a flag no XLA has")
    monkeypatch.setattr(xla_cpu, "CPU_FLAGS", (unknown, *CPU_FLAGS))
    env = {"XLA_FLAGS": "--a=1", **ASKED}
    assert set_cpu_flags(env).split() == ["--a=1", *OURS]
    # Probed once each, then the cache answers (no subprocess): keyed by the jaxlib version.
    with open(cache_home / "nnx_zoo" / "xla_flags.json") as f:
        cache = json.load(f)
    assert {key.split(" ", 1)[1]: takes for key, takes in cache.items()} == {
        "--xla_cpu_no_such_flag_anywhere=dot": False,
        **{flag: True for flag in OURS},
    }
    assert all(key.startswith("jaxlib==") for key in cache)

    def no_probe(*args, **kwargs):
        raise AssertionError("probed again")

    monkeypatch.setattr(subprocess, "run", no_probe)
    assert not xla_takes("--xla_cpu_no_such_flag_anywhere=dot")
    assert set_cpu_flags(dict(ASKED)) == " ".join(OURS)


CHILD = """
import numpy as np
from nnx_zoo.runtime.xla_cpu import set_cpu_flags
set_cpu_flags()
import jax, jax.numpy as jnp
a = np.random.default_rng(0).standard_normal((256, 384), np.float32)
b = np.random.default_rng(1).standard_normal((384, 128), np.float32)
f = jax.jit(jnp.dot)
# A library-kernel fusion is marked in the compiled HLO: "kind":"__ynn_fusion" (or __xnn...).
print("library_kernel", '"kind":"__' in f.lower(a, b).compile().as_text())
# float32 against float64: a kernel's summation order moves the result by ~1e-6 relative;
# 1e-4 catches a wrong result, not an order.
err = np.abs(np.asarray(f(a, b)) - a.astype(np.float64) @ b).max() / np.abs(a @ b).max()
print("error_ok", err < 1e-4)
"""


def test_xla_accepts_the_flags_and_the_dot_stays_right(cache_home):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2", **ASKED)
    out = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "library_kernel True" in out.stdout
    assert "error_ok True" in out.stdout
