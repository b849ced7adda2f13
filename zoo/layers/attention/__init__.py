"""Attention: the layer every family uses, and the function it calls, with pluggable backends.

| module              | concern                                                           |
|---------------------|-------------------------------------------------------------------|
| `layer`             | `Attention`, the NNX module: projections, RoPE, norms, the call   |
| `dispatch`          | `attention()`: runs a call on the named backend, or `auto`'s pick |
| `registry`          | backends by name, `auto`, `check_implementation` for entry points |
| `choices`           | what each call site ran on and why (`recording`), the refusal error |
| `layout`            | the shard_map layout fix for kernels that drop sharding types     |
| `xla`, `splash`, `cudnn` | the backends (each registers itself on import)               |
| `mask`              | `Segments` and the segment / position / window mask rule          |
| `context_parallel`  | attention with T split over `context`: K/V all-gathered, or a ring |
| `ring`, `ring_splash` | ring attention: K/V blocks permuted, online softmax; splash blocks |

A new backend is a module that calls `registry.register_backend`, imported by `dispatch`.
"""

from zoo.layers.attention.dispatch import attention
from zoo.layers.attention.layer import Attention
from zoo.layers.attention.mask import Segments, attention_mask
from zoo.layers.attention.registry import (
    AttentionBackend,
    CallInfo,
    backend_names,
    check_implementation,
    override_backend,
    register_backend,
    resolve_implementation,
)
from zoo.layers.config import ATTENTION_IMPLEMENTATIONS as IMPLEMENTATIONS

__all__ = [
    "IMPLEMENTATIONS",
    "Attention",
    "AttentionBackend",
    "CallInfo",
    "Segments",
    "attention",
    "attention_mask",
    "backend_names",
    "check_implementation",
    "override_backend",
    "register_backend",
    "resolve_implementation",
]
