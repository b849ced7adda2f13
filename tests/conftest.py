"""8 simulated CPU devices for every test, set before jax is imported anywhere; one JAX
compilation cache shared by the session's pytest workers and the train_main processes they
start."""

import atexit
import os
import shutil
import tempfile

from nnx_zoo.runtime.xla_cpu import set_cpu_flags, xla_takes

# The tests' programs are tiny and compiled once or twice each, so compiling, not running,
# is their cost: LLVM's cheaper pipeline compiles the suite's CPU programs in ~3/4 of the time
# (tests/test_moe_strategies.py: 102 -> 71 CPU-seconds). It changes neither the HLO passes
# (layouts, collectives, buffer assignment) nor what a comparison compares: both sides of one
# compile under the same flags, and the train_main processes the tests start inherit them.
CHEAP_COMPILE = (
    "--xla_force_host_platform_device_count=8"
    " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    # The tests that compile for an H100 here (no GPU to autotune on) take XLA's default
    # kernel configurations: newer XLA otherwise ranks every Triton GEMM's tilings with its
    # cost model, half of such a compile (jax 0.12: tiny's fsdp step on h100:8, 16 -> 9 s;
    # jax 0.10 does not, 6 s either way). Which kernels, collectives and buffers the step
    # has is decided before that; only each GEMM's tile sizes can differ.
    " --xla_gpu_autotune_level=0"
)
# XLA's older CPU backends (jax 0.10) also emit fusions through the elemental IR emitter
# instead of the MLIR fusion emitters when asked: a tiny train step compiles in ~0.6x the time
# (bench.core_step's compile 2.3 -> 1.4 s) and the floor leg's train tests take ~0.7x the
# CPU-seconds. Later XLA has only the MLIR emitters and aborts on the unknown flag, so it is
# added only where a CPU client starts with it.
LEGACY_FUSION_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
# The tests' data files live and die with their tmp_path: no index of them is cached in the
# user's ~/.cache (nnx_zoo/data/text_index.py; tests/test_text_streaming.py sets its own).
os.environ["ZOO_DATA_CACHE"] = "off"
_DECIDED = "NNX_ZOO_TEST_XLA_FLAGS"


# The first process to load this file (the xdist controller, or plain pytest) decides; its
# workers and the processes they start inherit the environment.
if _DECIDED not in os.environ:
    flags = CHEAP_COMPILE
    if xla_takes(LEGACY_FUSION_EMITTERS):  # probed once per jaxlib (runtime/xla_cpu.py)
        flags += " " + LEGACY_FUSION_EMITTERS
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()
    os.environ[_DECIDED] = flags
os.environ["JAX_PLATFORMS"] = "cpu"
# The XLA CPU flags an entry point starts with (nnx_zoo/runtime/xla_cpu.py: none unless
# ZOO_XLA_CPU_FLAGS=1): a run in this process (tests/_entry.py) then compiles the program a
# train_main process compiles, and the two agree bit for bit where a test compares them.
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
