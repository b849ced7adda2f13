"""Rematerialisation policies by name: what a block keeps for the backward pass.

The blocks tag their activations with `checkpoint_name` (NAMES below); a policy chooses
among them. Each policy promises less saved memory than the next in this order:
`full` <= `save_qkv_proj` <= `dots` <= `none` (`save_qkv_proj` keeps a subset of the
projection outputs `dots` keeps). `save_out_proj` and `offload` sit beside that order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from jax.ad_checkpoint import checkpoint_name

from nnx_zoo.errors import UsageError

# The activation names the blocks tag (zoo/layers/attention.py, mlp.py, decoder.py).
Q_PROJ, K_PROJ, V_PROJ = "q_proj", "k_proj", "v_proj"
OUT_PROJ = "out_proj"  # the attention output, after its o projection
MLP_GATE, MLP_UP = "mlp_gate", "mlp_up"
RESIDUAL = "residual"  # the residual stream entering each sub-block
Q_ROTATED, K_ROTATED = "q_rotated", "k_rotated"  # q and k after RoPE (and q/k norms)
NAMES = (Q_PROJ, K_PROJ, V_PROJ, OUT_PROJ, MLP_GATE, MLP_UP, RESIDUAL, Q_ROTATED, K_ROTATED)


@dataclasses.dataclass(frozen=True)
class Policy:
    """One remat policy: what it keeps, and the `jax.checkpoint` policy that does it."""

    description: str
    # () -> the jax.checkpoint policy; None: no rematerialisation at all.
    make: Callable[[], Any] | None
    # Moves activations to host memory, which some backends do not have (NO_HOST_MEMORY).
    offloads: bool = False


def _offload_residual():
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=[RESIDUAL],
        offload_src="device",
        offload_dst="pinned_host",
    )


def _dots_and_rotated(prim, *args, **params):
    """`dots_with_no_batch_dims_saveable`, and q / k as the attention kernel reads them.

    RoPE is linear in q and k, so its backward pass needs only the angles: with the rotated
    q and k kept, the projections' outputs are no longer read backward and are not kept, so
    the same bytes are held, and the backward pass no longer recomputes the rotation (nor
    q/k norms) before the attention kernel (llama3_1b compiled for H100: 0.18 GB of
    memory-bound traffic per layer)."""
    dots = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    return dots(prim, *args, **params) or _ROTATED(prim, *args, **params)


_ROTATED = jax.checkpoint_policies.save_only_these_names(Q_ROTATED, K_ROTATED)


# The one table of policies: the config, the flags and the planner read its names.
POLICIES = {
    "none": Policy(
        "no rematerialisation: keep every activation the backward pass reads", make=None
    ),
    "full": Policy(
        "keep nothing inside a block: recompute it in the backward pass",
        make=lambda: jax.checkpoint_policies.nothing_saveable,
    ),
    "dots": Policy(
        "keep every matmul output without batch dims (projections), q and k after RoPE in "
        "place of their projections; recompute the rest, attention scores included, so their "
        "O(T^2) memory is never kept",
        make=lambda: _dots_and_rotated,
    ),
    "save_qkv_proj": Policy(
        "keep the q/k/v projections; recompute the rest",
        make=lambda: jax.checkpoint_policies.save_only_these_names(Q_PROJ, K_PROJ, V_PROJ),
    ),
    "save_out_proj": Policy(
        "keep the attention output projection; recompute the rest",
        make=lambda: jax.checkpoint_policies.save_only_these_names(OUT_PROJ),
    ),
    "offload": Policy(
        "move the residual stream to host memory (TPU/GPU), recompute the rest",
        make=_offload_residual,
        offloads=True,
    ),
}

# Backends without a host memory space that XLA can offload to.
NO_HOST_MEMORY = ("cpu",)


def tag(x, name: str):
    """`x`, named for the remat policies (a no-op outside rematerialisation)."""
    return checkpoint_name(x, name)


def check_name(name: str) -> None:
    if name not in POLICIES:
        raise UsageError(f"remat={name!r}; valid: {', '.join(POLICIES)}")


def runs_on(name: str, platform: str) -> bool:
    """Whether `platform` can run policy `name`."""
    return not (POLICIES[name].offloads and platform in NO_HOST_MEMORY)


def check_platform(name: str, platform: str) -> None:
    """Raise a one-line UsageError when `platform` cannot run policy `name`."""
    if not runs_on(name, platform):
        here = ", ".join(n for n in POLICIES if runs_on(n, platform))
        raise UsageError(
            f"remat={name!r} moves activations to host memory, which the {platform} backend "
            f"does not have; on {platform} use {here}"
        )


def policy(name: str):
    """The `jax.checkpoint` policy for a name other than 'none'."""
    check_name(name)
    make = POLICIES[name].make
    if make is None:
        raise UsageError(f"remat={name!r} has no policy (it means no rematerialisation)")
    return make()
