"""`jax.lax.ragged_all_to_all`'s documented semantics from dense all_to_alls, for the tests of
the ragged MoE exchange on CPU (XLA:CPU cannot lower the real one). It moves the padded bytes,
so it tests the exchange's offset arithmetic, not its traffic."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from zoo.layers.moe_exchange import override_ragged_all_to_all


def emulated_ragged_all_to_all(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name
):
    """One slice per peer: each slice padded to the operand's rows, sent with a dense
    all_to_all, and written at its offset in `output`."""
    N = operand.shape[0]
    rows = jnp.arange(N)
    take_dN = jnp.minimum(input_offsets[:, None] + rows[None, :], N - 1)
    valid_dN = rows[None, :] < send_sizes[:, None]
    mask = valid_dN.reshape(valid_dN.shape + (1,) * (operand.ndim - 1))
    slices = jnp.where(mask, operand[take_dN], 0)
    got = jax.lax.all_to_all(slices, axis_name, 0, 0, tiled=True)  # [source, N, ...]
    at_s = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
    target_sN = jnp.where(
        rows[None, :] < recv_sizes[:, None], at_s[:, None] + rows[None, :], output.shape[0]
    )
    return output.at[target_sN.reshape(-1)].set(got.reshape((-1,) + operand.shape[1:]), mode="drop")


def emulate_ragged_all_to_all(packet_rows: int = 0):
    """A `with` block in which the ragged exchange runs on the emulation (any backend)."""
    return override_ragged_all_to_all(emulated_ragged_all_to_all, packet_rows)
