"""Leaf modules: a sharded einsum projection, an embedding table, RMS/Layer norms.

Each takes its sharding dataclass, creates its weights with the declared layout, and calls
its op with the declared `out` layout; none chooses a layout itself.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from shardings.specs import EmbeddingSharding, LinearSharding, NormSharding, axes_of, normalize
from zoo.layers import quant

INIT_STD = 0.02  # GPT-2 / Llama initializer; depth is handled by the residual structure


def _normal(rngs: nnx.Rngs, shape, spec, std=INIT_STD):
    # Created directly with its layout: under jit no device ever holds the full array.
    return std * jax.random.normal(rngs.params(), shape, jnp.float32, out_sharding=spec)


def projection_options(cfg, rngs: nnx.Rngs) -> dict:
    """Einsum's keywords that every projection of a block takes from the config: its init
    rngs, bias, compute dtype and quantization."""
    return dict(
        rngs=rngs, use_bias=cfg.use_bias, dtype=cfg.compute_dtype, quantization=cfg.quantization
    )


class Einsum(nnx.Module):
    """`y = einsum(eq, x, w) + b`, e.g. 'BTM,MND->BTND' for a q projection.

    `quantization` ('none' | 'fp8' | 'int8') runs the einsum on quantized operands
    (zoo/layers/quant.py); the bias is added in the compute dtype.

    Weight shape is given whole (`(M, N, D)`), so heads are a real dim that a strategy can
    split and a mesh check can name.
    """

    def __init__(
        self,
        eq: str,
        weight_shape: tuple[int, ...],
        sharding: LinearSharding,
        *,
        rngs: nnx.Rngs,
        use_bias: bool = False,
        dtype=jnp.float32,
        quantization: str = "none",
    ):
        quant.check(quantization)
        if quantization != "none":
            quant.check_equation(eq)
        self.eq = eq
        self.quantization = quantization
        self.sharding = sharding
        self.dtype = dtype
        self.weight = nnx.Param(
            _normal(rngs, weight_shape, sharding.weight), out_sharding=sharding.weight
        )
        out_dims = eq.split("->")[1]
        w_dims = eq.split("->")[0].split(",")[1]
        # Bias covers the output features that come from the weight (N, D or F or M).
        self.bias_shape = tuple(weight_shape[w_dims.index(c)] for c in out_dims if c in w_dims)
        self.bias = (
            nnx.Param(
                jnp.zeros(self.bias_shape, jnp.float32, out_sharding=sharding.bias),
                out_sharding=sharding.bias,
            )
            if use_bias
            else None
        )
        # A LoRA adapter (zoo/layers/lora.py) that `add_lora` may attach; None: plain.
        self.lora = nnx.data(None)

    def __call__(self, x):
        w = self.weight[...].astype(self.dtype)
        if self.quantization == "none":
            y = jnp.einsum(self.eq, x.astype(self.dtype), w, out_sharding=self.sharding.out)
        else:  # fp8 / int8 operands forward and backward (zoo/layers/quant.py)
            y = quant.qeinsum(self.eq, self.quantization, self.sharding.out, x.astype(w.dtype), w)
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        if self.lora is not None:
            y = y + self.lora(x)
        return y


class Embed(nnx.Module):
    def __init__(
        self, num: int, dim: int, sharding: EmbeddingSharding, *, rngs: nnx.Rngs, dtype=jnp.float32
    ):
        self.sharding = sharding
        self.dtype = dtype
        self.table = nnx.Param(
            _normal(rngs, (num, dim), sharding.table), out_sharding=sharding.table
        )

    def __call__(self, ids_BT):
        # A gather from a split table needs its output layout spelled out under explicit
        # axes (JAX cannot infer it from batch-split ids).
        table = self.table[...].astype(self.dtype)
        return gather_rows(table, ids_BT, self.sharding.out)


def gather_rows(table_VM, ids_BT, out_spec):
    """`table_VM[ids_BT]` laid out as `out_spec` ([B, T, M]).

    When B is split over several axes and the table's M over some of them (hsdp: rows over
    (replica, data), M over data; a pipeline: rows over (data, stage)), XLA's gather
    partitioner gives up and all-gathers the whole table (1 GiB of bf16 per step for Llama
    3's). Spelled out instead: B as one dim per axis; the ids gathered over the table's
    axes (4 bytes a token); the lookup keeps the rows of the other axes where they are and
    the table's M split; one all-to-all brings each row's M together on its own device.
    """
    mesh = jax.typeof(table_VM).sharding.mesh
    out = normalize(out_spec, 3)
    rows = axes_of(out[0])
    table_axes = axes_of(normalize(jax.typeof(table_VM).sharding.spec, 2)[1])
    if mesh.empty or len(rows) < 2 or not set(rows) & set(table_axes):
        return table_VM.at[ids_BT].get(out_sharding=out_spec)
    B, T = ids_BT.shape
    sizes = [mesh.shape[a] for a in rows]
    b = B // math.prod(sizes)
    seq = normalize(jax.typeof(ids_BT).sharding.spec, 2)[1]
    ids = ids_BT.reshape(*sizes, b, T, out_sharding=P(*rows, None, seq))
    kept = [None if a in table_axes else a for a in rows]
    ids = jax.sharding.reshard(ids, P(*kept, None, seq))
    x = table_VM.at[ids].get(out_sharding=P(*kept, None, seq, table_axes or None))
    x = jax.sharding.reshard(x, P(*rows, None, seq, out[2]))
    return x.reshape(B, T, table_VM.shape[1], out_sharding=out_spec)


class Norm(nnx.Module):
    """RMSNorm (Llama; `plus_one` for Gemma's (1 + w) scale) or LayerNorm with bias (GPT-2).

    Statistics are taken in float32 whatever the compute dtype; the result is cast back and
    moved to `sharding.out` (with a split residual this is the all-gather over `model`).
    """

    def __init__(
        self,
        dim: int,
        sharding: NormSharding,
        *,
        kind: str = "rms",
        eps: float = 1e-5,
        plus_one: bool = False,
        dtype=jnp.float32,
    ):
        self.sharding = sharding
        self.kind = kind
        self.eps = eps
        self.plus_one = plus_one
        self.dtype = dtype
        init = 0.0 if plus_one else 1.0
        self.weight = nnx.Param(
            jnp.full((dim,), init, jnp.float32, out_sharding=sharding.weight),
            out_sharding=sharding.weight,
        )
        self.bias = (
            nnx.Param(
                jnp.zeros((dim,), jnp.float32, out_sharding=sharding.weight),
                out_sharding=sharding.weight,
            )
            if kind == "layer"
            else None
        )

    def __call__(self, x, out_sharding=None):
        """`out_sharding`: the result's layout instead of `sharding.out` (the final norm
        inside a pipeline's 1F1B loop, whose rows are not split over `stage` there)."""
        with jax.named_scope("norm"):  # profiles and bench/step_breakdown.py read the name
            return self._normalize(x, out_sharding)

    def _normalize(self, x, out_sharding):
        x32 = x.astype(jnp.float32)
        if self.kind == "layer":
            x32 = x32 - jnp.mean(x32, axis=-1, keepdims=True)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        scale = self.weight[...] + 1.0 if self.plus_one else self.weight[...]
        y = y * scale
        if self.bias is not None:
            y = y + self.bias[...]
        out = self.sharding.out if out_sharding is None else out_sharding
        return jax.sharding.reshard(y.astype(self.dtype), out)
