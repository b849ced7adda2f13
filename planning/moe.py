"""What the planner says about a mixture-of-experts step: the token exchange's bytes against the
routed payload, so a padded exchange (e times the payload) shows as such."""

from __future__ import annotations

import numpy as np

# Dispatch and combine, forward and backward; a remat policy that recomputes the block's
# forward ('full') runs the forward pair again.
_EXCHANGES = {"full": 6}


def routed_payload_bytes(cfg, tokens_per_device: int, remat: str, dtype: str) -> int:
    """All-to-all bytes per step per device if each exchange sent exactly its routed rows:
    exchanges per layer x layers x tokens per device x k x M x the compute dtype's bytes."""
    if not cfg.is_moe:
        return 0
    per_exchange = tokens_per_device * cfg.num_experts_per_tok * cfg.hidden_dim
    return (
        _EXCHANGES.get(remat, 4)
        * cfg.num_layers
        * per_exchange
        * np.dtype("bfloat16" if dtype == "bfloat16" else "float32").itemsize
    )


def exchange_summary(plan, cfg) -> dict:
    """{'all_to_all_bytes', 'routed_payload_bytes', 'all_to_all_over_payload'} for an MoE plan
    with an expert axis; {} otherwise."""
    expert = plan.mesh.get("expert", 1)
    if not cfg.is_moe or expert == 1:
        return {}
    sent = sum(c.executions * c.array_bytes for c in plan.collectives if "all-to-all" in c.op)
    # The devices holding distinct tokens: `model` devices share theirs.
    tokens = plan.global_batch * plan.seq_len // (plan.mesh.get("data", 1) * expert)
    payload = routed_payload_bytes(cfg, tokens, plan.candidate.remat, cfg.dtype)
    return {
        "all_to_all_bytes": sent,
        "routed_payload_bytes": payload,
        "all_to_all_over_payload": round(sent / payload, 3) if payload else None,
    }
