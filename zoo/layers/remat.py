"""Rematerialisation policies by name: what a block keeps for the backward pass.

The blocks tag their activations with `checkpoint_name` (NAMES below); a policy chooses
among them. Each policy promises less saved memory than the next in this order:
`full` <= `save_qkv_proj` <= `dots` <= `none` (`save_qkv_proj` keeps a subset of the
projection outputs `dots` keeps). `save_out_proj` and `offload` sit beside that order.
"""

from __future__ import annotations

import jax
from jax.ad_checkpoint import checkpoint_name

# The activation names the blocks tag (zoo/layers/attention.py, mlp.py, decoder.py).
Q_PROJ, K_PROJ, V_PROJ = "q_proj", "k_proj", "v_proj"
OUT_PROJ = "out_proj"  # the attention output, after its o projection
MLP_GATE, MLP_UP = "mlp_gate", "mlp_up"
RESIDUAL = "residual"  # the residual stream entering each sub-block
NAMES = (Q_PROJ, K_PROJ, V_PROJ, OUT_PROJ, MLP_GATE, MLP_UP, RESIDUAL)

POLICIES = {
    "none": "no rematerialisation: keep every activation the backward pass reads",
    "full": "keep nothing inside a block: recompute it in the backward pass",
    "dots": "keep every matmul output without batch dims (projections); recompute the rest, "
    "attention scores included, so their O(T^2) memory is never kept",
    "save_qkv_proj": "keep the q/k/v projections; recompute the rest",
    "save_out_proj": "keep the attention output projection; recompute the rest",
    "offload": "move the residual stream to host memory (TPU/GPU), recompute the rest",
}

# Backends without a host memory space that XLA can offload to.
_NO_OFFLOAD_PLATFORMS = ("cpu",)


def tag(x, name: str):
    """`x`, named for the remat policies (a no-op outside rematerialisation)."""
    return checkpoint_name(x, name)


def check_name(name: str) -> None:
    if name not in POLICIES:
        raise ValueError(f"remat={name!r}; valid: {', '.join(POLICIES)}")


def check_platform(name: str, platform: str) -> None:
    """Raise a one-line ValueError when `platform` cannot run policy `name`."""
    if name == "offload" and platform in _NO_OFFLOAD_PLATFORMS:
        raise ValueError(
            f"remat='offload' moves activations to host memory, which the {platform} backend "
            "does not have; on cpu use none, full, dots, save_qkv_proj or save_out_proj"
        )


def policy(name: str):
    """The `jax.checkpoint` policy for a name other than 'none'."""
    check_name(name)
    cp = jax.checkpoint_policies
    if name == "full":
        return cp.nothing_saveable
    if name == "dots":
        return cp.dots_with_no_batch_dims_saveable
    if name == "save_qkv_proj":
        return cp.save_only_these_names(Q_PROJ, K_PROJ, V_PROJ)
    if name == "save_out_proj":
        return cp.save_only_these_names(OUT_PROJ)
    if name == "offload":
        return cp.save_and_offload_only_these_names(
            names_which_can_be_saved=[],
            names_which_can_be_offloaded=[RESIDUAL],
            offload_src="device",
            offload_dst="pinned_host",
        )
    raise ValueError(f"remat={name!r} has no policy (it means no rematerialisation)")
