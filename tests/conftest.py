"""8 simulated CPU devices for every test, set before jax is imported anywhere; one JAX
compilation cache shared by the session's pytest workers and the train_main processes they
start."""

import atexit
import os
import shutil
import tempfile

from nnx_zoo.runtime.xla_cpu import set_cpu_flags

# The tests' programs are tiny and compiled once or twice each, so compiling, not running,
# is their cost: LLVM's cheaper pipeline compiles the suite's CPU programs in ~3/4 of the time
# (tests/test_moe_strategies.py: 102 -> 71 CPU-seconds). It changes neither the HLO passes
# (layouts, collectives, buffer assignment) nor what a comparison compares: both sides of one
# compile under the same flags, and the train_main processes the tests start inherit them.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
).strip()
os.environ["JAX_PLATFORMS"] = "cpu"
# The XLA CPU flags every entry point starts with (nnx_zoo/runtime/xla_cpu.py): a run in this
# process (tests/_entry.py) then compiles the program a train_main process compiles, and the
# two agree bit for bit where a test compares them.
set_cpu_flags()
# Tests that compile for TPU targets load libtpu; pytest workers and other processes on the
# same host may hold it too, and compiling without running is safe to share.
os.environ["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
# Many tests run train_main in a subprocess on the same tiny config, and every subprocess would
# compile the same step again: JAX's persistent cache (keyed by the program, the compile
# options and the JAX/XLA versions, so a hit is the executable a fresh compile makes) halves
# such a run. The first process to load this file (the xdist controller, or plain pytest)
# makes the directory; workers and subprocesses inherit it through the environment.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="nnx-zoo-jax-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], True)
# Every program, not only those that took over a second to compile (JAX's default): a tiny
# model's steps compile in under a second each on a quiet host, and tests that run the same
# tiny run in-process (tests/_entry.py) rebuild, and so recompile, them each time.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import jax  # noqa: E402

assert jax.device_count() == 8, f"tests need 8 simulated CPU devices, got {jax.device_count()}"
