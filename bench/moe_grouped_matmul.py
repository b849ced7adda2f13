"""jax.lax.ragged_dot against megablox's grouped matmul (jax.experimental.pallas.ops.tpu), both
compiled for one v5p chip on this host (no TPU needed): the HLO each becomes, XLA's cost
analysis and the compiled temp memory of one expert SwiGLU forward + backward.

    python -m bench.moe_grouped_matmul --rows=32768 --hidden=2048 --ffn=768 --experts=16

Default shapes: one device of qwen3-30b-a3b under fsdp_ep on v5p:4x4x4 at 64x4096 (4096
tokens x k=8 routed rows, 128 experts / expert 8 = 16 local ones). Timing needs the chip;
this shows what each lowers to (XLA keeps ragged-dot as its own op on TPU; megablox is a
Mosaic custom call), so an adoption decision waits for a measured step.
"""

from __future__ import annotations

import os
import re

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile-only: no local accelerator is probed

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from absl import app, flags  # noqa: E402
from jax.experimental.pallas.ops.tpu.megablox import gmm  # noqa: E402

_ROWS = flags.DEFINE_integer("rows", 32768, "routed rows on the device (tokens x k)")
_HIDDEN = flags.DEFINE_integer("hidden", 2048, "M")
_FFN = flags.DEFINE_integer("ffn", 768, "F of one expert")
_EXPERTS = flags.DEFINE_integer("experts", 16, "local experts")


def _swiglu(matmul):
    def loss(x, gate, up, down, sizes):
        g = matmul(x, gate, sizes)
        u = matmul(x, up, sizes)
        return jnp.sum(matmul(jax.nn.silu(g) * u, down, sizes).astype(jnp.float32))

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))


def _ragged(x, w, sizes):
    return jax.lax.ragged_dot(x, w, sizes)


def _megablox(x, w, sizes):
    return gmm(x, w, sizes, preferred_element_type=x.dtype)


def main(argv):
    del argv
    from nnx_zoo.planning.targets import target_devices

    device = target_devices("v5p:2x2x2")[0]
    X, M, F, E = _ROWS.value, _HIDDEN.value, _FFN.value, _EXPERTS.value
    sharding = jax.sharding.SingleDeviceSharding(device)
    spec = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=sharding)  # noqa: E731
    args = (
        spec(X, M),
        spec(E, M, F),
        spec(E, M, F),
        spec(E, F, M),
        jax.ShapeDtypeStruct((E,), jnp.int32, sharding=sharding),
    )
    useful = 3 * 3 * 2 * X * M * F  # three matmuls, forward + two backward, 2 flops a MAC
    print(f"rows {X} M {M} F {F} local experts {E}: useful flops {useful:.3e}")
    for name, matmul in (("ragged_dot", _ragged), ("megablox gmm", _megablox)):
        compiled = _swiglu(matmul).lower(*args).compile()
        text = compiled.as_text()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        ops = sorted(set(re.findall(r"\b(ragged-dot|custom_call_target=\"[^\"]+\")", text)))
        memory = compiled.memory_analysis()
        print(
            f"{name:13s} ops {ops} flops {cost.get('flops', float('nan')):.3e} "
            f"bytes {cost.get('bytes accessed', float('nan')):.3e} "
            f"temp {memory.temp_size_in_bytes / 2**20:.0f} MiB"
        )


if __name__ == "__main__":
    app.run(main)
