"""8 simulated CPU devices for every test, set before jax is imported anywhere."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ["JAX_PLATFORMS"] = "cpu"
# Tests that compile for TPU targets load libtpu; pytest workers and other processes on the
# same host may hold it too, and compiling without running is safe to share.
os.environ["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"

import jax  # noqa: E402

assert jax.device_count() == 8, f"tests need 8 simulated CPU devices, got {jax.device_count()}"
