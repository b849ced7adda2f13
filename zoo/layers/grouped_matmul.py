"""The experts' matmul over rows sorted by expert: `jax.lax.ragged_dot`, or tiles for XLA:GPU.

`grouped_matmul(x_XM, w_EMF, group_sizes_E)`: row r of x, in expert e's contiguous group, times
w[e]; rows past the groups' total come out zero. Two forms, picked per compile platform
(`resolve_matmul`):

- `ragged_dot` (TPU, CPU): `jax.lax.ragged_dot`. TPU lowers it to a grouped-matmul kernel
  (a Mosaic custom call) whose temporaries do not grow with E.
- `tiled` (GPU): XLA:GPU (jaxlib 0.10.2) has no grouped kernel for ragged_dot: it rewrites it
  as one dense matmul of every row against every expert ([X, E*M] x [E*M, F], each row copied
  E times and masked), so its temporaries are X x E x M and its FLOPs E times the groups'
  (measured on the h100 target: 16 MiB per expert at X=4096, M=2048 bf16, forward; the
  same `xla_gpu_experimental_use_ragged_dot_*` options change nothing). Here the sorted rows
  are cut into tiles of `TILE` rows, and a work item is a (tile, expert) pair whose expert's
  group meets the tile: at most tiles + E - 1 items, in (expert, tile) order. One loop over
  the items multiplies its tile by its expert's matrix, rows of other experts masked to zero,
  and adds the product into the tile's output rows. Temporaries: the output and one tile and
  one expert's matrix at a time; FLOPs (X + (E - 1) x TILE) x M x F x 2.

The tiled form is exact: a row is in one item only (its tile, its expert), so each output row
is its row times its expert's matrix plus zeros. Its gradient is its own (`jax.custom_vjp`):
the input's is the same loop on the transposed matrices, the matrices' one loop of
tile^T x (masked output gradient) accumulated per expert in float32 (as a matmul accumulates
its contraction) and cast once, so a bf16 expert's gradient is rounded once, not per tile.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp

from nnx_zoo.errors import UsageError

MATMULS = ("ragged_dot", "tiled")
# Rows per tile: a multiple of the GPU matmul tiles (64, 128), small next to a group.
TILE = 128

_FORCED = {"matmul": None}


@contextlib.contextmanager
def force_matmul(name: str):
    """Inside the block every grouped matmul takes form `name` on any platform (tests run the
    GPU form on CPU this way)."""
    if name not in MATMULS:
        raise UsageError(f"grouped matmul {name!r}; valid: {', '.join(MATMULS)}")
    before = _FORCED["matmul"]
    _FORCED["matmul"] = name
    try:
        yield
    finally:
        _FORCED["matmul"] = before


def resolve_matmul(name: str, platform: str) -> str:
    """The form a config's `moe_matmul` names; 'auto': 'tiled' where ragged_dot is lowered
    densely over the experts (GPU), else 'ragged_dot'."""
    if _FORCED["matmul"] is not None:
        return _FORCED["matmul"]
    if name != "auto":
        return name
    return "tiled" if platform in ("gpu", "cuda", "rocm") else "ragged_dot"


def grouped_matmul(x_XM, w_EMF, group_sizes_E, matmul: str = "ragged_dot", tile: int = 0):
    """[X, F]: each row of `x_XM` (sorted by expert, `group_sizes_E[e]` rows for expert e)
    times its expert's [M, F] matrix; rows past the groups' total zero. `tile`: the tiled
    form's rows per tile (0: `TILE`)."""
    if matmul == "ragged_dot":
        return jax.lax.ragged_dot(x_XM, w_EMF, group_sizes_E)
    return _tiled(x_XM, w_EMF, group_sizes_E, tile or TILE)


def _items(group_sizes_E, rows: int, tile: int):
    """(each row's expert [rows] (E past the groups), each item's tile [G], each item's
    expert [G] (-1: no item, so it matches no row), G = rows / tile + E - 1."""
    E = group_sizes_E.shape[0]
    n = rows // tile
    ends_E = jnp.cumsum(group_sizes_E)
    expert_R = jnp.searchsorted(ends_E, jnp.arange(rows), side="right")
    first_n = expert_R[::tile]
    last_n = jnp.minimum(expert_R[tile - 1 :: tile], E - 1)
    count_n = jnp.maximum(last_n - first_n + 1, 0)  # 0: the tile is past every group
    cum_n = jnp.cumsum(count_n)
    item_G = jnp.arange(n + E - 1)
    tile_G = jnp.minimum(jnp.searchsorted(cum_n, item_G, side="right"), n - 1)
    expert_G = first_n[tile_G] + item_G - (cum_n - count_n)[tile_G]
    return expert_R, tile_G, jnp.where(item_G < cum_n[-1], expert_G, -1)


def _pad(x_XM, tile: int):
    rows = -(-x_XM.shape[0] // tile) * tile
    return jnp.pad(x_XM, ((0, rows - x_XM.shape[0]), (0, 0))), rows


def _varying(x) -> set:
    return set(jax.typeof(x).manual_axis_type.varying)


def _zeros(shape, dtype, *like):
    """Zeros varying over the manual (shard_map) mesh axes that any of `like` varies over:
    a loop carry must keep one type, and the products added into it vary as its inputs do."""
    z = jnp.zeros(shape, dtype)
    axes = set().union(*(_varying(x) for x in like)) - _varying(z)
    return jax.lax.pcast(z, tuple(sorted(axes)), to="varying") if axes else z


def _loop(x_RM, w_EMF, expert_R, tile_G, expert_G, tile: int):
    """[R, F]: the items' products, each added into its tile's rows."""

    def body(out_RF, item):
        i, e = item
        x_tM = jax.lax.dynamic_slice_in_dim(x_RM, i * tile, tile)
        mine_t = jax.lax.dynamic_slice_in_dim(expert_R, i * tile, tile) == e
        w_MF = jax.lax.dynamic_index_in_dim(w_EMF, jnp.maximum(e, 0), keepdims=False)
        y_tF = jnp.where(mine_t[:, None], jnp.dot(x_tM, w_MF), 0).astype(out_RF.dtype)
        before_tF = jax.lax.dynamic_slice_in_dim(out_RF, i * tile, tile)
        return jax.lax.dynamic_update_slice_in_dim(out_RF, before_tF + y_tF, i * tile, 0), None

    dtype = jnp.result_type(x_RM.dtype, w_EMF.dtype)
    out_RF = _zeros((x_RM.shape[0], w_EMF.shape[-1]), dtype, x_RM, w_EMF, expert_R, expert_G)
    return jax.lax.scan(body, out_RF, (tile_G, expert_G))[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _tiled(x_XM, w_EMF, group_sizes_E, tile):
    x_RM, rows = _pad(x_XM, tile)
    items = _items(group_sizes_E, rows, tile)
    return _loop(x_RM, w_EMF, *items, tile)[: x_XM.shape[0]]


def _tiled_fwd(x_XM, w_EMF, group_sizes_E, tile):
    return _tiled(x_XM, w_EMF, group_sizes_E, tile), (x_XM, w_EMF, group_sizes_E)


def _tiled_bwd(tile, residuals, dy_XF):
    x_XM, w_EMF, group_sizes_E = residuals
    X = x_XM.shape[0]
    x_RM, rows = _pad(x_XM, tile)
    dy_RF, _ = _pad(dy_XF, tile)
    expert_R, tile_G, expert_G = _items(group_sizes_E, rows, tile)
    dx_XM = _loop(dy_RF, jnp.swapaxes(w_EMF, 1, 2), expert_R, tile_G, expert_G, tile)[:X]

    def body(dw_EMF, item):
        i, e = item
        x_tM = jax.lax.dynamic_slice_in_dim(x_RM, i * tile, tile)
        mine_t = jax.lax.dynamic_slice_in_dim(expert_R, i * tile, tile) == e
        dy_tF = jnp.where(mine_t[:, None], jax.lax.dynamic_slice_in_dim(dy_RF, i * tile, tile), 0)
        part_MF = jnp.dot(x_tM.T, dy_tF, preferred_element_type=jnp.float32)
        e = jnp.maximum(e, 0)  # no item: its part is zero
        before_MF = jax.lax.dynamic_index_in_dim(dw_EMF, e, keepdims=False)
        return jax.lax.dynamic_update_index_in_dim(dw_EMF, before_MF + part_MF, e, 0), None

    dw_EMF = jax.lax.scan(
        body, _zeros(w_EMF.shape, jnp.float32, x_RM, dy_RF, expert_G), (tile_G, expert_G)
    )[0]
    return _like(dx_XM.astype(x_XM.dtype), x_XM), _like(dw_EMF.astype(w_EMF.dtype), w_EMF), None


def _like(ct, primal):
    """A cotangent summed over the manual axes it varies over and its primal does not (inside
    shard_map: the primal was the same on those devices, each holding a part of its
    gradient), as autodiff's transpose of the implicit broadcast does."""
    axes = _varying(ct) - _varying(primal)
    return jax.lax.psum(ct, tuple(sorted(axes))) if axes else ct


_tiled.defvjp(_tiled_fwd, _tiled_bwd)
