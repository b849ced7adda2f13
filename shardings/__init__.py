"""Sharding as data: spec dataclasses, named strategies, explicit meshes."""

from shardings.mesh import check_batch, check_divisible, make_mesh, parse_mesh_shape
from shardings.specs import (
    AttentionSharding,
    BlockSharding,
    EmbeddingSharding,
    LinearSharding,
    LmSharding,
    MlpSharding,
    MoeSharding,
    NormSharding,
)
from shardings.strategies import (
    CONTEXT,
    DATA,
    EXPERT,
    MODEL,
    REPLICA,
    STRATEGIES,
    Strategy,
    get_strategy,
)

__all__ = [
    "CONTEXT",
    "DATA",
    "EXPERT",
    "MODEL",
    "REPLICA",
    "STRATEGIES",
    "AttentionSharding",
    "BlockSharding",
    "EmbeddingSharding",
    "LinearSharding",
    "LmSharding",
    "MlpSharding",
    "MoeSharding",
    "NormSharding",
    "Strategy",
    "check_batch",
    "check_divisible",
    "get_strategy",
    "make_mesh",
    "parse_mesh_shape",
]
