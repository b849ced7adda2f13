"""Feed-forward blocks: gated (SwiGLU, GeGLU) or plain (GPT-2)."""

from __future__ import annotations

import jax
from flax import nnx

from nnx_zoo.errors import UsageError
from shardings.specs import MlpSharding
from zoo.layers import remat
from zoo.layers.basic import Einsum, projection_options

ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
}


class Mlp(nnx.Module):
    def __init__(self, cfg, sharding: MlpSharding, *, rngs: nnx.Rngs):
        M, F = cfg.hidden_dim, cfg.ffn_dim
        if cfg.activation not in ACTIVATIONS:
            raise UsageError(f"activation={cfg.activation!r}; valid: {', '.join(ACTIVATIONS)}")
        self.sharding = sharding
        self.activation = cfg.activation
        common = projection_options(cfg, rngs)
        self.gate = Einsum("BTM,MF->BTF", (M, F), sharding.gate, **common) if cfg.glu else None
        self.up = Einsum("BTM,MF->BTF", (M, F), sharding.up, **common)
        self.down = Einsum("BTF,FM->BTM", (F, M), sharding.down, **common)

    def __call__(self, x_BTM):
        act = ACTIVATIONS[self.activation]
        up_BTF = remat.tag(self.up(x_BTM), remat.MLP_UP)
        if self.gate is None:
            h_BTF = act(up_BTF)
        else:
            h_BTF = act(remat.tag(self.gate(x_BTM), remat.MLP_GATE)) * up_BTF
        with jax.named_scope("down"):
            return self.down(h_BTF)
