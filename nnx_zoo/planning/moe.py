"""What the planner says about a mixture-of-experts step: the token exchange's bytes against the
routed payload, so a padded exchange (e times the payload) shows as such; and, given a run's
metrics (`--moe_load_from`), how unevenly the router loads the experts and the expert shards."""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from nnx_zoo.errors import UsageError

METRICS_FILE = "metrics.jsonl"

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
        * cfg.moe_layers
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


@dataclasses.dataclass(frozen=True)
class MeasuredLoad:
    """The router's load measured by a run: each expert's share of the assignments (mean over
    layers and the last `steps` logged steps) and the busiest expert's share over the mean
    (worst layer, mean over those steps)."""

    workdir: str
    steps: int
    expert_share: tuple[float, ...]
    expert_spread: float

    def shard_spread(self, expert: int) -> float:
        """The busiest expert shard's rows over the mean shard's, the E experts split in
        contiguous blocks over an `expert` axis of this size (as the fsdp_ep rules lay them)."""
        shares = np.asarray(self.expert_share).reshape(expert, -1).sum(axis=1)
        return float(shares.max() * expert / shares.sum())


def load_from_run(workdir: str, num_experts: int, last: int = 10) -> MeasuredLoad:
    """The load a train_main run of the same MoE model logged (a short CPU run is enough to
    see a router's habits at this batch); UsageError with one line when there is none."""
    from nnx_zoo.runtime import storage

    path = storage.join(workdir, METRICS_FILE)  # a local path, or a run's gs:// / s3:// workdir
    try:
        lines = storage.read_bytes(path).decode("utf-8").splitlines()
    except OSError as e:
        raise UsageError(
            f"--moe_load_from={workdir}: cannot read {METRICS_FILE} there "
            f"({e.strerror or e}); give the workdir of a train_main run of this MoE model"
        ) from None
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a killed run
        if "expert_load" in record and "moe_load_spread" in record:
            records.append(record)
    if not records:
        raise UsageError(
            f"--moe_load_from={workdir}: {METRICS_FILE} has no router load (expert_load); "
            "give the workdir of a train_main run of an MoE model"
        )
    records = records[-last:]
    share = np.mean([r["expert_load"] for r in records], axis=0)
    if share.shape != (num_experts,):
        raise UsageError(
            f"--moe_load_from={workdir}: that run routed over {share.size} experts, this "
            f"model has {num_experts}; give a run of the same model"
        )
    return MeasuredLoad(
        workdir=workdir,
        steps=len(records),
        expert_share=tuple(float(x) for x in share),
        expert_spread=float(np.mean([r["moe_load_spread"] for r in records])),
    )


def load_summary(measured: MeasuredLoad, plan) -> dict:
    """The plan's MoE fields for a measured load: the busiest expert's and the busiest expert
    shard's load over the mean. The busiest shard's grouped matmuls and received rows are that
    many times the balanced figures, and the step waits for it."""
    expert = plan.mesh.get("expert", 1)
    return {
        "load_from": measured.workdir,
        "load_steps": measured.steps,
        "load_spread_expert": round(measured.expert_spread, 4),
        "load_spread_shard": round(measured.shard_spread(expert), 4),
    }
