"""nnx_zoo/runtime/compat.py: each version difference it handles, on both sides.

The recorded messages are what each end of pyproject's range raised (jax 0.10.2 on the floor,
jax 0.12.0.1 at the newest); the live test makes the installed jax raise it, so each CI leg
checks its own side against the same pattern."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from nnx_zoo.runtime import compat

# Verbatim (but for the file path) from jax 0.10.2 and jax 0.12.0.1.
FLOOR_MESSAGE = (
    "Custom VJP bwd rule must produce an output with the same type as the args tuple of the "
    "primal function, but at output[0] the bwd rule produced an output of type "
    "float32[8,32,8,16] corresponding to an input of type float32[8@data,32,8@model,16]"
)
NEWEST_MESSAGE = (
    "Custom VJP bwd rule attached to call at /home/user/nnx zoo/tests/test_attention_layout.py:62"
    " must produce an output with the same type as the args tuple of the primal function, but at"
    " output[0] the bwd rule produced an output of type float32[8,32,8,16] corresponding to an "
    "input of type float32[8@data,32,8@model,16]"
)


@pytest.mark.parametrize("message", [FLOOR_MESSAGE, NEWEST_MESSAGE], ids=["floor", "newest"])
def test_the_pattern_matches_each_ends_wording(message):
    assert compat.CUSTOM_VJP_TYPE_MISMATCH.search(message)


def test_the_pattern_does_not_match_other_custom_vjp_errors():
    # jax's other bwd-rule errors (wrong container, symbolic zeros) are different mistakes.
    other = "Custom VJP bwd rule must produce an output with the same container (pytree structure)"
    assert not compat.CUSTOM_VJP_TYPE_MISMATCH.search(other)


def test_the_installed_jax_raises_what_the_pattern_matches():
    """A backward rule that drops its cotangent's sharding: the installed jax's own error."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))

    @jax.custom_vjp
    def identity(x):
        return x

    def fwd(x):
        return x, None

    def bwd(_, g):
        return (jax.sharding.reshard(g, P()),)  # typed unsharded: not the input's type

    identity.defvjp(fwd, bwd)
    with jax.set_mesh(mesh):
        x = jax.device_put(jnp.ones((8, 4)), P("data"))
        with pytest.raises(ValueError) as raised:
            jax.grad(lambda x: identity(x).sum())(x)
    message = str(raised.value)
    assert compat.CUSTOM_VJP_TYPE_MISMATCH.search(message), message
    # Which side this is: the wording names the call site from jax 0.11 on.
    newer = compat.jax_version() >= compat.CUSTOM_VJP_NAMES_CALL_SITE_SINCE
    assert ("bwd rule attached to " in message) == newer, (compat.jax_version(), message)


def test_versions_names_the_installed_jax():
    found = compat.versions()
    assert found["jax"] == jax.__version__
    assert compat.jax_version()[:3] == tuple(int(p) for p in jax.__version__.split(".")[:3])
    assert found["python"].count(".") == 2
