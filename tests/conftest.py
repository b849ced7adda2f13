"""8 simulated CPU devices for every test, set before jax is imported anywhere; one JAX
compilation cache shared by the session's pytest workers and the train_main processes they
start."""

import atexit
import os
import shutil
import tempfile

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ["JAX_PLATFORMS"] = "cpu"
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

import jax  # noqa: E402

assert jax.device_count() == 8, f"tests need 8 simulated CPU devices, got {jax.device_count()}"
