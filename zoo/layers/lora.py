"""LoRA adapters on the model's projections: `y = x W + (alpha / r) * dropout(x) A B`.

An adapter is a pair of `LoraParam` variables, a kind of its own (not `nnx.Param`), so an
optimizer built with `wrt=LoraParam` trains only the adapters while every `nnx.Param` of
the base stays frozen (and may be stored in bfloat16). Layouts come from the projection's
own `LinearSharding`, so every strategy's rule table decides them too:

  A [in dims..., R]   the input dims laid out like the base weight's input dims, R whole;
  B [R, out dims...]  R whole, the output dims laid out like the base weight's output dims;
  the [B, T, R] activation between them keeps the batch layout of the projection's output.

E.g. q (`BTM,MND->BTND`, fsdp_tp: `M/data N/model D`): A [M/data, R], B [R, N/model, D].
R is small (8..64): splitting it would only add collectives.

B starts at zero (so an adapted model starts as exactly the base model) and A at PEFT's
default, Kaiming-uniform with a = sqrt(5) over the input features.

`add_lora(model, config, rngs)` attaches adapters to the targets of every block (stacked
with a leading L when the blocks are scanned, like the base weights); `merge_lora(model)`
folds them into the base weights (W + scale * A B) and removes them.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from nnx_zoo.errors import UsageError
from shardings.specs import LinearSharding, normalize
from zoo.layers.basic import Einsum

# Target names (PEFT's for attention, short ones for the MLP) -> the path of the projection
# inside a block.
TARGETS: dict[str, tuple[str, str]] = {
    "q_proj": ("attention", "q"),
    "k_proj": ("attention", "k"),
    "v_proj": ("attention", "v"),
    "o_proj": ("attention", "o"),
    "gate": ("mlp", "gate"),
    "up": ("mlp", "up"),
    "down": ("mlp", "down"),
}
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


class LoraParam(nnx.Variable):
    """A LoRA adapter matrix: what trains while the base model's `nnx.Param`s stay frozen."""


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    rank: int  # r, the adapters' inner width
    alpha: float  # the update is scaled by alpha / r (PEFT's lora_alpha)
    dropout: float = 0.0  # dropout on the adapter's input while training (PEFT's lora_dropout)
    targets: tuple[str, ...] = DEFAULT_TARGETS

    def __post_init__(self):
        if not isinstance(self.rank, int) or self.rank <= 0:
            raise UsageError(f"config lora.rank={self.rank!r}: must be an integer > 0")
        if not self.alpha > 0:
            raise UsageError(f"config lora.alpha={self.alpha!r}: must be > 0")
        if not 0 <= self.dropout < 1:
            raise UsageError(f"config lora.dropout={self.dropout!r}: must be in [0, 1)")
        unknown = [t for t in self.targets if t not in TARGETS]
        if unknown or not self.targets:
            raise UsageError(
                f"config lora.targets={','.join(self.targets)!r}: "
                f"{'unknown ' + ', '.join(unknown) if unknown else 'empty'}; "
                f"valid: {', '.join(TARGETS)} (comma-separated)"
            )

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def _dims(eq: str):
    """('BTM,MND->BTND') -> (x_sub, w_sub, out_sub, in_dims, out_dims, rest, rank letter)."""
    lhs, out_sub = eq.split("->")
    x_sub, w_sub = lhs.split(",")
    in_dims = "".join(c for c in w_sub if c in x_sub)
    out_dims = "".join(c for c in w_sub if c in out_sub)
    rest = "".join(c for c in x_sub if c not in in_dims)
    r = next(c for c in "RZYXWQPJ" if c not in eq)
    return x_sub, w_sub, out_sub, in_dims, out_dims, rest, r


class LoraAdapter(nnx.Module):
    """The low-rank update of one `Einsum` projection (one layer's; see the module docstring)."""

    def __init__(
        self,
        eq: str,
        weight_shape: tuple[int, ...],
        sharding: LinearSharding,
        config: LoraConfig,
        *,
        rngs: nnx.Rngs,
        dtype=jnp.float32,
    ):
        x_sub, w_sub, out_sub, in_dims, out_dims, rest, r = _dims(eq)
        w_spec = normalize(sharding.weight, len(w_sub))
        out_spec = normalize(sharding.out, len(out_sub))
        size = dict(zip(w_sub, weight_shape, strict=True))
        a_shape = (*(size[c] for c in in_dims), config.rank)
        b_shape = (config.rank, *(size[c] for c in out_dims))
        a_spec = P(*(w_spec[w_sub.index(c)] for c in in_dims), None)
        b_spec = P(None, *(w_spec[w_sub.index(c)] for c in out_dims))
        self.h_spec = P(*(out_spec[out_sub.index(c)] for c in rest), None)
        self.out_spec = sharding.out
        self.eq_a = f"{x_sub},{in_dims}{r}->{rest}{r}"
        self.eq_b = f"{rest}{r},{r}{out_dims}->{out_sub}"
        self.scale = config.scale
        self.dropout_rate = config.dropout
        self.dtype = dtype
        # PEFT: nn.init.kaiming_uniform_(A, a=sqrt(5)) -> U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
        bound = 1.0 / math.sqrt(math.prod(a_shape[:-1]))
        a = jax.random.uniform(
            rngs.params(), a_shape, jnp.float32, -bound, bound, out_sharding=a_spec
        )
        self.a = LoraParam(a, out_sharding=a_spec)
        self.b = LoraParam(
            jnp.zeros(b_shape, jnp.float32, out_sharding=b_spec), out_sharding=b_spec
        )
        self.dropout = (
            nnx.Dropout(config.dropout, rngs=nnx.Rngs(dropout=rngs.dropout()))
            if config.dropout
            else None
        )

    def __call__(self, x):
        x = x.astype(self.dtype)
        if self.dropout is not None:
            x = self.dropout(x)
        h = jnp.einsum(self.eq_a, x, self.a[...].astype(self.dtype), out_sharding=self.h_spec)
        y = jnp.einsum(self.eq_b, h, self.b[...].astype(self.dtype), out_sharding=self.out_spec)
        return y * jnp.asarray(self.scale, y.dtype)

    def delta(self, leading: str = ""):
        """scale * A B in the base weight's layout ([in..., out...] in its own dim order),
        float32; `leading` names extra leading dims both carry (the layer dim 'L')."""
        eq_a, eq_b = self.eq_a, self.eq_b
        in_r = eq_a.split(",")[1].split("->")[0]
        r_out = eq_b.split(",")[1].split("->")[0]
        return self.scale * jnp.einsum(
            f"{leading}{in_r},{leading}{r_out}->{leading}{in_r[:-1]}{r_out[1:]}",
            self.a[...].astype(jnp.float32),
            self.b[...].astype(jnp.float32),
        )


def _target_modules(model, target: str) -> list[tuple[tuple, Einsum]]:
    """(path, Einsum) of every block's projection named by `target`."""
    parent, leaf = TARGETS[target]
    found = []
    for path, module in nnx.iter_graph(model):
        if (
            isinstance(module, Einsum)
            and len(path) >= 2
            and (path[-2], path[-1]) == (parent, leaf)
            and "blocks" in path
        ):
            found.append((path, module))
    return found


def _layer_dims(module: Einsum) -> int:
    """Leading dims of a (stacked) weight beyond its einsum's: 1 when scanned, else 0."""
    w_sub = module.eq.split("->")[0].split(",")[1]
    return module.weight[...].ndim - len(w_sub)


def _maker(eq, shape, sharding, config, dtype):
    # Closes over plain values only: a closure over the module (a graph node) would be
    # reached from inside the transforms below.
    def make(rngs):
        return LoraAdapter(eq, shape, sharding, config, rngs=rngs, dtype=dtype)

    return make


def add_lora(model, config: LoraConfig, rngs: nnx.Rngs) -> list[str]:
    """Attach adapters to `config.targets` in every block of `model`, under the active mesh.
    Returns the adapted paths. UsageError (one line) when a target names no module of this
    model (e.g. 'gate' on GPT-2, whose MLP has none)."""
    if config.dropout and model.sharding.stage_axis is not None:
        # The pipeline runs each layer from a copy of its weights (zoo/layers/pipeline.py)
        # and does not carry the dropout's RNG state back: every step would drop the same.
        raise UsageError(
            f"config lora.dropout={config.dropout} does not run under a pipeline strategy "
            "(its masks would repeat every step); use lora.dropout=0 there, or a strategy "
            "without a `stage` axis"
        )
    if model.sharding.stage_axis is not None and model.cfg.pipeline_schedule == "1f1b":
        # The 1F1B loop computes every stage weight's gradient as it goes
        # (zoo/layers/pipeline_1f1b.py): the frozen base weights' too, a third of the
        # backward's matmuls spent on gradients nobody reads; not built for adapters.
        raise UsageError(
            "LoRA adapters do not train under pipeline_schedule=1f1b; use "
            "pipeline_schedule=gpipe (or auto) with a pipeline strategy"
        )
    found = []
    for target in config.targets:
        modules = _target_modules(model, target)
        if not modules:
            raise UsageError(
                f"config lora.targets: {target!r} names no module of this model "
                f"({type(model.cfg).__name__}); valid here: "
                f"{', '.join(t for t in TARGETS if _target_modules(model, t))}"
            )
        found += modules
    # The adapters' L follows the base weights' L (the rule table's `layers`: split over
    # `stage` under a pipeline strategy), so that each stage holds the adapters of the
    # layers it runs.
    layer_axis = model.sharding.stage_axis
    makers = []
    for _, module in found:
        stacked = _layer_dims(module)
        shape = tuple(module.weight[...].shape[stacked:])
        make = _maker(module.eq, shape, module.sharding, config, module.dtype)
        if stacked:
            make = nnx.split_rngs(splits=module.weight[...].shape[0])(
                nnx.vmap(
                    make,
                    in_axes=0,
                    out_axes=0,
                    transform_metadata={nnx.PARTITION_NAME: layer_axis},
                )
            )
        makers.append(make)
    # One compiled program makes them all (one per target would compile once each).
    made = nnx.jit(lambda rngs: [make(rngs) for make in makers])(rngs)
    for (_, module), adapter in zip(found, made, strict=True):
        if layer_axis is not None and _layer_dims(module):
            _lay_out_recorded(adapter)
        module.lora = adapter
    return ["/".join(map(str, path)) for path, _ in found]


def _lay_out_recorded(adapter) -> None:
    """vmap records the layer split in each variable's metadata but creates L unsplit (as
    for the base blocks, zoo/layers/decoder.py): move each value onto its recorded layout."""
    for _, var in nnx.to_flat_state(nnx.state(adapter)):
        spec = var.get_metadata().get("out_sharding")
        if spec is not None:
            var.set_value(jax.sharding.reshard(var.get_value(), P(*spec)))


def adapters(model) -> list[tuple[tuple, Einsum]]:
    """(path, Einsum) of every adapted projection."""
    return [
        (path, m)
        for path, m in nnx.iter_graph(model)
        if isinstance(m, Einsum) and getattr(m, "lora", None) is not None
    ]


def has_lora(model) -> bool:
    return bool(adapters(model))


def trainable(model):
    """The variable kind the optimizer trains: the adapters when there are any, else every
    parameter."""
    return LoraParam if has_lora(model) else nnx.Param


def merge_lora(model) -> None:
    """Fold every adapter into its base weight (W += scale * A B, in float32, stored in the
    weight's dtype) and remove it: the result is an ordinary model."""
    for _, module in adapters(model):
        stacked = _layer_dims(module)
        delta = module.lora.delta("L" if stacked else "")
        weight = module.weight[...]
        merged = (weight.astype(jnp.float32) + delta.astype(jnp.float32)).astype(weight.dtype)
        module.weight.set_value(jax.sharding.reshard(merged, jax.typeof(weight).sharding.spec))
        module.lora = nnx.data(None)
