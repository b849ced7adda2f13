"""Muon for the blocks' hidden matrices, AdamW for the rest, Newton-Schulz laid out per strategy.

The transformation is `optax.contrib.muon`'s, piece for piece (the same momentum, quintic
Newton-Schulz iteration, shape scaling, decoupled weight decay and, for every other parameter,
optax's `adamw` with Nesterov momentum), with two differences that make it run on a sharded
model:

- Which parameters are matrices, and which of their dims are the matrix's rows (the dims the
  projection contracts: its input) and columns (its output), comes from the parameter's path
  (`HIDDEN_MATRICES`); every leading dim (the scanned stack's L, an MoE layer's experts E) is a
  batch of independent matrices. Everything else -- embeddings, the LM head, norms, biases,
  the MoE router, LoRA adapters -- goes to AdamW.
- The iteration runs on whole matrices: each momentum matrix is first resharded so that its
  row and column dims are on one device and its batch dims carry the mesh axes instead (as
  many as divide them), then orthogonalized there by einsums with explicit output layouts
  (no collective inside the iteration), then resharded back to the parameter's layout. With
  a layer stack L divisible by the devices that is one all-to-all in and one out per
  parameter, each device orthogonalizing L / devices layers; an axis that divides no batch
  dim leaves the matrices whole on each of its devices (gathered, and the iteration repeated
  there). `replica` (the axis between slices) is never used: its devices repeat the work
  rather than send the update over the slow links.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from optax.contrib import MuonDimensionNumbers, MuonState

from shardings.hybrid import REPLICA
from shardings.specs import axes_of, normalize

# optax.contrib.muon's default quintic coefficients (Keller Jordan's).
NS_COEFFS = (3.4445, -4.7750, 2.0315)

# (module, weight) -> which dims of the weight's trailing matrix dims are rows (contracted:
# the projection's input) and which are columns (its output); dims before them are batch.
# Names as the zoo's blocks spell them (zoo/layers/attention/layer.py, mla.py, mlp.py, moe.py,
# moe_grouped.py).
HIDDEN_MATRICES: dict[tuple[str, str], MuonDimensionNumbers] = {
    # [.., M, N, D] / [.., M, K, D]: x_M -> heads x head_dim. Rows M, columns N*D (K*D).
    ("attention", "q"): MuonDimensionNumbers(reduction_axis=-3, output_axis=(-2, -1)),
    ("attention", "k"): MuonDimensionNumbers(reduction_axis=-3, output_axis=(-2, -1)),
    ("attention", "v"): MuonDimensionNumbers(reduction_axis=-3, output_axis=(-2, -1)),
    # [.., N, D, M]: heads x head_dim -> M. Rows N*D, columns M.
    ("attention", "o"): MuonDimensionNumbers(reduction_axis=(-3, -2), output_axis=-1),
    # [.., M, F] (gate, up) and [.., F, M] (down): rows the input, columns the output.
    ("mlp", "gate"): MuonDimensionNumbers(reduction_axis=-2, output_axis=-1),
    ("mlp", "up"): MuonDimensionNumbers(reduction_axis=-2, output_axis=-1),
    ("mlp", "down"): MuonDimensionNumbers(reduction_axis=-2, output_axis=-1),
    # [.., E, M, F] and [.., E, F, M]: one matrix per expert, E a batch dim.
    ("moe", "gate"): MuonDimensionNumbers(reduction_axis=-2, output_axis=-1),
    ("moe", "up"): MuonDimensionNumbers(reduction_axis=-2, output_axis=-1),
    ("moe", "down"): MuonDimensionNumbers(reduction_axis=-2, output_axis=-1),
    # An MoE layer's shared experts (an Mlp named `shared`): as the mlp's.
    ("shared", "gate"): MuonDimensionNumbers(reduction_axis=-2, output_axis=-1),
    ("shared", "up"): MuonDimensionNumbers(reduction_axis=-2, output_axis=-1),
    ("shared", "down"): MuonDimensionNumbers(reduction_axis=-2, output_axis=-1),
    # Multi-head latent attention (zoo/layers/mla.py); its `o` is the attention's above.
    # [.., M, Q] / [.., M, C + r]: x_M -> the query / key-value latent.
    ("attention", "q_a"): MuonDimensionNumbers(reduction_axis=-2, output_axis=-1),
    ("attention", "kv_a"): MuonDimensionNumbers(reduction_axis=-2, output_axis=-1),
    # [.., Q, N, D] / [.., C, N, d + Dv]: a latent -> heads x head dims.
    ("attention", "q_b"): MuonDimensionNumbers(reduction_axis=-3, output_axis=(-2, -1)),
    ("attention", "kv_b"): MuonDimensionNumbers(reduction_axis=-3, output_axis=(-2, -1)),
}


def in_layer_stack(names: Sequence[str]) -> bool:
    """Whether a parameter path runs through a stack of layers: `blocks`, or any stack
    named `*_blocks` (deepseek_v3's `dense_blocks`, its dense first layers)."""
    return any(n == "blocks" or n.endswith("_blocks") for n in names)


@dataclasses.dataclass(frozen=True)
class MuonOptions:
    """Muon's own settings (the optimizer section's `muon_*` fields)."""

    momentum: float = 0.95  # Nesterov momentum of the matrices' gradients
    ns_steps: int = 5  # Newton-Schulz iterations
    # Updates scaled to this RMS x sqrt(max(rows, columns)) (Liu et al. 2025), so AdamW's
    # learning rate and weight decay carry over; 0: sqrt(max(1, columns / rows)) (Jordan).
    consistent_rms: float = 0.2


def _names(path: Sequence[Any]) -> list[str]:
    names = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                names.append(str(getattr(key, attr)))
                break
        else:
            names.append(str(key))
    # At `init` nnx.Optimizer hands optax `nnx.Param` variables, whose leaves end in 'value'.
    return names[:-1] if names and names[-1] == "value" else names


def dimension_numbers(path: Sequence[Any], leaf: Any = None) -> MuonDimensionNumbers | None:
    """The matrix dims of the parameter at `path` if Muon trains it, else None (AdamW).

    A hidden matrix is a projection inside a layer stack (`in_layer_stack`): an einsum
    module's `weight` (`blocks/attention/q/weight`, `blocks/0/mlp/down/weight` unscanned,
    `dense_blocks/attention/kv_b/weight`) or an MoE expert stack (`blocks/moe/gate`).
    """
    del leaf
    names = _names(path)
    if not in_layer_stack(names) or len(names) < 3:
        return None
    key = tuple(names[-3:-1]) if names[-1] == "weight" else tuple(names[-2:])
    return HIDDEN_MATRICES.get(key)


def dimension_numbers_tree(params: Any) -> Any:
    """`params` with each leaf replaced by its `dimension_numbers` (None: AdamW), the form
    `optax.contrib.muon(muon_weight_dimension_numbers=...)` takes."""
    return jax.tree_util.tree_map_with_path(dimension_numbers, params)


def _axes(x: jax.Array, dims: MuonDimensionNumbers):
    """(batch, rows, columns): the dims of `x` in each role, non-negative."""

    def norm(axes):
        return tuple(a % x.ndim for a in ((axes,) if isinstance(axes, int) else axes))

    rows, cols = norm(dims.reduction_axis), norm(dims.output_axis)
    batch = tuple(i for i in range(x.ndim) if i not in rows + cols)
    return batch, rows, cols


def ns_layout(shape, spec: P, batch: Sequence[int], mesh) -> P:
    """The layout the iteration runs in: matrix dims whole; the batch dims keep their axes
    and take each further axis (in mesh order, but never `replica`) that still divides one
    of them, the first that it divides."""
    spec = normalize(spec, len(shape))
    assigned = {i: list(axes_of(spec[i])) for i in batch}
    taken = {a for axes in assigned.values() for a in axes}
    for axis in mesh.axis_names:
        if axis in taken or axis == REPLICA or mesh.shape[axis] == 1:
            continue
        for i in batch:
            ways = math.prod(mesh.shape[a] for a in assigned[i]) * mesh.shape[axis]
            if shape[i] % ways == 0:
                assigned[i].append(axis)
                taken.add(axis)
                break
    entries = [None] * len(shape)
    for i, axes in assigned.items():
        entries[i] = None if not axes else axes[0] if len(axes) == 1 else tuple(axes)
    return P(*entries)


def _explicit(sharding) -> bool:
    mesh = getattr(sharding, "mesh", None)
    return (
        mesh is not None and not mesh.empty and all(t == AxisType.Explicit for t in mesh.axis_types)
    )


def newton_schulz(x, coeffs, steps: int, eps: float, out_sharding=None):
    """optax's quintic iteration on the last two dims of `x` ([..., R, C]), batched over the
    rest, each einsum's output laid out as `out_sharding` ([..., *, *], matrix dims whole)."""
    transposed = x.shape[-2] > x.shape[-1]
    if transposed:  # the iteration is cheaper on the wide side: X X^T is min(R, C) square
        x = jnp.swapaxes(x, -1, -2)
    norm = jnp.sqrt(jnp.sum(x * x, axis=(-2, -1), keepdims=True))
    x = x / (norm + eps)
    c = coeffs.astype(x.dtype)
    for _ in range(steps):
        a = jnp.einsum("...rc,...sc->...rs", x, x, out_sharding=out_sharding)
        aa = jnp.einsum("...rs,...st->...rt", a, a, out_sharding=out_sharding)
        b = c[1] * a + c[2] * aa
        x = c[0] * x + jnp.einsum("...rs,...sc->...rc", b, x, out_sharding=out_sharding)
    return jnp.swapaxes(x, -1, -2) if transposed else x


def orthogonalize(x: jax.Array, dims: MuonDimensionNumbers, coeffs, steps: int, eps: float):
    """Each matrix of `x` (rows and columns per `dims`, every other dim a batch) replaced by
    its Newton-Schulz orthogonalization, in `ns_layout` and back to `x`'s layout."""
    batch, rows, cols = _axes(x, dims)
    sharding = jax.typeof(x).sharding
    explicit = _explicit(sharding)
    spec = normalize(sharding.spec, x.ndim) if explicit else None
    if explicit:
        x = jax.sharding.reshard(x, ns_layout(x.shape, spec, batch, sharding.mesh))
    order = batch + rows + cols
    moved = jnp.transpose(x, order)  # local: only whole (unsplit) dims move past each other
    batch_shape = tuple(x.shape[i] for i in batch)
    matrix_spec = None
    if explicit:
        layout = normalize(jax.typeof(moved).sharding.spec, moved.ndim)
        matrix_spec = P(*layout[: len(batch)], None, None)
    r = math.prod(x.shape[i] for i in rows)
    c = math.prod(x.shape[i] for i in cols)
    m = moved.reshape(*batch_shape, r, c, out_sharding=matrix_spec)
    m = newton_schulz(m, coeffs, steps, eps, out_sharding=matrix_spec)
    back = jnp.transpose(
        m.reshape(moved.shape, out_sharding=jax.typeof(moved).sharding if explicit else None),
        tuple(order.index(i) for i in range(x.ndim)),
    )
    return jax.sharding.reshard(back, spec) if explicit else back


def scale_by_muon(options: MuonOptions, eps: float) -> optax.GradientTransformation:
    """`optax.contrib.scale_by_muon` (Nesterov, Frobenius pre-scaling) with its iteration in
    `orthogonalize`'s layouts; every leaf it sees must be a hidden matrix."""
    beta, steps = options.momentum, options.ns_steps

    def init(params):
        return MuonState(
            count=jnp.zeros([], jnp.int32),
            mu=optax.tree.zeros_like(params),
            ns_coeffs=jnp.asarray(NS_COEFFS),
        )

    def update(updates, state, params=None):
        del params
        mu = optax.tree.update_moment(updates, state.mu, beta, 1)
        count = optax.safe_increment(state.count)
        mu_hat = jax.tree.map(
            lambda m, g: beta * m + (1 - beta) * g,
            optax.tree.bias_correction(mu, beta, optax.safe_increment(count)),
            optax.tree.bias_correction(updates, beta, count),
        )
        out = jax.tree_util.tree_map_with_path(
            lambda p, x: orthogonalize(x, dimension_numbers(p), state.ns_coeffs, steps, eps),
            mu_hat,
        )
        return out, MuonState(count=count, mu=mu, ns_coeffs=state.ns_coeffs)

    return optax.GradientTransformation(init, update)


def scale_by_shape(consistent_rms: float) -> optax.GradientTransformation:
    """optax.contrib.muon's shape scaling: consistent RMS when > 0, else width transfer."""

    def scale(path, u):
        _, rows, cols = _axes(u, dimension_numbers(path))
        fan_in = math.prod(u.shape[i] for i in rows)
        fan_out = math.prod(u.shape[i] for i in cols)
        if consistent_rms > 0:
            return u * (math.sqrt(max(fan_in, fan_out)) * consistent_rms)
        return u * math.sqrt(max(1.0, fan_out / fan_in))

    def update(updates, state, params=None):
        del params
        return jax.tree_util.tree_map_with_path(scale, updates), state

    return optax.GradientTransformation(optax.init_empty_state, update)


class PartitionState(NamedTuple):
    muon: Any  # the Muon chain's state over the hidden matrices
    adam: Any  # AdamW's over the rest


def _group_paths(tree: Any):
    """(names, is a hidden matrix) for each leaf of `tree`, in its flattening order."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    named = [(_names(path), leaf) for path, leaf in flat]
    return named, treedef


def _split(tree: Any) -> tuple[dict, dict]:
    """(hidden matrices, the rest): two nested dicts of `tree`'s leaves under their path's
    names, so each half's own transformation sees the paths (the weight-decay mask, the
    dimension numbers) and holds state for its own leaves only."""
    groups: tuple[dict, dict] = ({}, {})
    named, _ = _group_paths(tree)
    for names, leaf in named:
        node = groups[dimension_numbers(names) is None]
        for name in names[:-1]:
            node = node.setdefault(name, {})
        node[names[-1]] = leaf
    return groups


def _merge(like: Any, matrices: dict, rest: dict) -> Any:
    """`like`'s structure with each leaf taken from the half `_split` put it in."""
    named, treedef = _group_paths(like)
    leaves = []
    for names, _ in named:
        node = rest if dimension_numbers(names) is None else matrices
        for name in names:
            node = node[name]
        leaves.append(node)
    return treedef.unflatten(leaves)


def partition(matrices_tx, rest_tx) -> optax.GradientTransformation:
    """`matrices_tx` on the hidden matrices, `rest_tx` on the rest (`optax.partition` with
    `labels`, whose masked states hold an `optax.MaskedNode` wherever a leaf belongs to the
    other half: flax 0.12.8's `nnx.eval_shape`, which builds the abstract optimizer the
    planner compiles, fails on those)."""

    def init(params):
        matrices, rest = _split(params)
        return PartitionState(matrices_tx.init(matrices), rest_tx.init(rest))

    def update(updates, state, params=None):
        matrices, rest = _split(updates)
        p_matrices, p_rest = _split(params) if params is not None else (None, None)
        u_matrices, s_matrices = matrices_tx.update(matrices, state.muon, p_matrices)
        u_rest, s_rest = rest_tx.update(rest, state.adam, p_rest)
        return _merge(updates, u_matrices, u_rest), PartitionState(s_matrices, s_rest)

    return optax.GradientTransformation(init, update)


def muon(
    learning_rate: optax.ScalarOrSchedule,
    options: MuonOptions,
    *,
    b1: float,
    b2: float,
    eps: float,
    weight_decay: float,
    adam_weight_decay_mask: Any = None,
) -> optax.GradientTransformation:
    """Muon on the hidden matrices, optax's Nesterov AdamW on every other parameter, one
    learning rate and weight decay for both (as `optax.contrib.muon` with
    `adam_weight_decay=weight_decay` and `muon_weight_dimension_numbers=dimension_numbers_tree`,
    plus a weight-decay mask on the AdamW side)."""
    return partition(
        optax.chain(
            scale_by_muon(options, eps),
            scale_by_shape(options.consistent_rms),
            optax.add_decayed_weights(weight_decay),
            optax.scale_by_learning_rate(learning_rate),
        ),
        optax.adamw(
            learning_rate=learning_rate,
            b1=b1,
            b2=b2,
            eps=eps,
            weight_decay=weight_decay,
            mask=adam_weight_decay_mask,
            nesterov=True,
        ),
    )


def newton_schulz_flops(params: Any, steps: int) -> int:
    """FLOPs of one step's iterations over every hidden matrix of `params` (arrays or
    ShapeDtypeStructs), all devices together: per R x C matrix (R <= C) and iteration,
    X X^T (2 R^2 C), A A (2 R^3) and B X (2 R^2 C). The planner's forecast, which counts
    the model's FLOPs from its config, does not include them."""
    total = 0
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        dims = dimension_numbers(path)
        if dims is None:
            continue
        batch, rows, cols = _axes(x, dims)
        r = math.prod(x.shape[i] for i in rows)
        c = math.prod(x.shape[i] for i in cols)
        r, c = min(r, c), max(r, c)
        total += math.prod(x.shape[i] for i in batch) * steps * (4 * r * r * c + 2 * r**3)
    return total
