"""Optimizer (AdamW + a learning-rate schedule + clipping) and gradient accumulation over
micro-batches (the schedules themselves: `nnx_zoo/training/schedules.py`).

Used as::

    tx, schedule = make_optimizer(learning_rate=3e-4, warmup_steps=100, total_steps=10_000)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

Nothing here knows a model family; the weight-decay mask works on parameter *paths*.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from nnx_zoo.errors import UsageError
from nnx_zoo.training import muon as muon_lib
from nnx_zoo.training.muon import MuonOptions
from nnx_zoo.training.schedules import make_schedule
from shardings.specs import normalize

# Weight decay is off for any parameter whose path has a component containing one of these
# (case-insensitive): norm scales/biases ('attn_norm', 'mlp_norm', 'final_norm', 'q_norm', ...),
# embedding tables ('embed', 'embedding', 'embed_tokens', GPT-2 'wte'/'wpe', learned 'position'
# tables) and biases. Decaying them pulls norm gains towards 0 and rare tokens' embeddings
# towards the origin, which hurts; the LM head kernel is a matmul weight and *is* decayed
# (unless tied, in which case it is the embedding and is not).
NO_DECAY_SUBSTRINGS: tuple[str, ...] = ("norm", "embed", "wte", "wpe", "position", "bias")
# Path components that exclude only on an exact match: 'scale' is what Flax norms call their
# gain, whatever the norm module is named (e.g. GPT-2's 'ln_1').
NO_DECAY_NAMES: tuple[str, ...] = ("scale",)


def _path_names(path: Sequence[Any]) -> list[str]:
    """Lower-case names of a key path's components (DictKey, GetAttrKey, SequenceKey...)."""
    names = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                names.append(str(getattr(key, attr)).lower())
                break
        else:
            names.append(str(key).lower())
    return names


def decays(path: Sequence[Any], leaf: Any) -> bool:
    """Whether weight decay applies to the parameter at `path`.

    The rule: decay a parameter unless a component of its path contains one of
    `NO_DECAY_SUBSTRINGS` ('norm', 'embed', 'wte', 'wpe', 'position', 'bias') or equals one of
    `NO_DECAY_NAMES` ('scale'), and never decay a parameter with fewer than 2 dims (a vector is
    a gain or a bias whatever it is called). Only the path can tell a stacked norm scale
    `[L, M]` (2-D, not decayed) from a kernel, which is why the names come first.
    """
    names = _path_names(path)
    if any(s in name for name in names for s in NO_DECAY_SUBSTRINGS):
        return False
    if any(name in NO_DECAY_NAMES for name in names):
        return False
    return jnp.ndim(leaf) >= 2


def weight_decay_mask(params: Any) -> Any:
    """A pytree of bools with `params`' structure: True where weight decay applies.

    optax calls this with two different trees under `nnx.Optimizer(model, tx, wrt=nnx.Param)`
    (flax 0.12.8): at `init`, an `nnx.State` whose leaves are `nnx.Param` variables (their
    paths end in `.value`); at `update`, an `nnx.State` of raw arrays. Both flatten to the same
    arrays under `tree_map_with_path`, and the trailing 'value' component matches no rule.
    """
    return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(
    *,
    learning_rate: float,
    warmup_steps: int,
    total_steps: int,
    end_learning_rate_ratio: float = 0.1,
    b1: float = 0.9,
    b2: float = 0.95,
    eps: float = 1e-8,
    weight_decay: float = 0.1,
    clip_grad_norm: float | None = 1.0,
    decay_norms_and_embeddings: bool = False,
    schedule: str = "cosine",
    decay_fraction: float = 0.2,
    decay_shape: str = "linear",
    muon: MuonOptions | None = None,
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW with a linear warmup then `schedule`'s decay, after clipping by global norm.

    Args:
      learning_rate: peak learning rate, reached at `warmup_steps`.
      warmup_steps: steps of linear warmup from 0 to the peak.
      total_steps: length of the whole schedule (warmup included); after it the rate stays at
        `learning_rate * end_learning_rate_ratio` (cosine, wsd).
      end_learning_rate_ratio: final rate as a fraction of the peak.
      schedule, decay_fraction, decay_shape: 'cosine', 'wsd' or 'constant', and WSD's decay
        (`nnx_zoo.training.schedules.make_schedule`).
      b1, b2, eps: Adam moments' decay rates and epsilon.
      weight_decay: decoupled (AdamW) weight decay coefficient, multiplied by the current rate.
      clip_grad_norm: clip the gradients' global norm to this; None or <= 0 turns it off.
      decay_norms_and_embeddings: False (default) masks weight decay off as `decays` says;
        True decays every parameter.
      muon: Muon's settings: Muon on the blocks' hidden matrices and Nesterov AdamW on the
        rest (nnx_zoo/training/muon.py), both at this schedule and weight decay; None: AdamW.

    Returns:
      (tx, schedule): the optax transformation and the step -> learning-rate function (for
      logging the rate actually used at a step).
    """
    schedule = make_schedule(
        schedule,
        learning_rate=learning_rate,
        warmup_steps=warmup_steps,
        total_steps=total_steps,
        end_learning_rate_ratio=end_learning_rate_ratio,
        decay_fraction=decay_fraction,
        decay_shape=decay_shape,
    )
    adamw = optax.adamw(
        learning_rate=schedule,
        b1=b1,
        b2=b2,
        eps=eps,
        weight_decay=weight_decay,
        mask=None if decay_norms_and_embeddings else weight_decay_mask,
    )
    if muon is not None:  # the same settings, AdamW's for what is not a hidden matrix
        adamw = muon_lib.muon(
            schedule,
            muon,
            b1=b1,
            b2=b2,
            eps=eps,
            weight_decay=weight_decay,
            adam_weight_decay_mask=None if decay_norms_and_embeddings else weight_decay_mask,
        )
    if clip_grad_norm is None or clip_grad_norm <= 0:
        return adamw, schedule
    # Clip first: Adam normalises per coordinate, so clipping after it would do little.
    return optax.chain(optax.clip_by_global_norm(clip_grad_norm), adamw), schedule


LossAndGradFn = Callable[[Any, Mapping[str, jax.Array]], tuple[tuple[jax.Array, jax.Array], Any]]


def _split_micro_batches(x: jax.Array, num_micro_batches: int, batch_spec: P | None) -> jax.Array:
    """[B, ...] -> [k, B/k, ...] where micro-batch j holds rows j, j+k, j+2k, ...

    Strided, not contiguous, so that with B sharded on 'data' every micro-batch takes B/k rows
    from each device's own shard: `reshape` to [B/k, k, ...] splits each device's rows locally
    and the swap of the two leading axes moves no data. A contiguous split would put each
    micro-batch on a fraction of the devices and force a reshard. Which rows share a
    micro-batch does not change the accumulated sums.
    """
    k = num_micro_batches
    b = x.shape[0]
    if b % k:
        raise UsageError(f"batch size {b} is not divisible by num_micro_batches={k}")
    new_shape = (b // k, k, *x.shape[1:])
    if batch_spec is None:
        x = jnp.reshape(x, new_shape)
    else:
        spec = normalize(batch_spec, x.ndim)
        x = jnp.reshape(x, new_shape, out_sharding=P(spec[0], None, *spec[1:]))
    return jnp.swapaxes(x, 0, 1)  # -> [k, B/k, ...], the batch sharding now on axis 1


class Accumulated(NamedTuple):
    """What `accumulate_gradients` returns."""

    loss: jax.Array  # token-mean loss over the batch
    num_tokens: jax.Array  # counted tokens
    grads: Any  # gradient of the mean loss
    means: dict  # the function's `sums` divided by the token count ({} when it gives none)


def accumulate_gradients(
    loss_and_grad_fn: LossAndGradFn,
    params: Any,
    batch: Mapping[str, jax.Array],
    num_micro_batches: int,
    *,
    batch_spec: P | None = None,
) -> Accumulated:
    """Token-weighted mean loss and gradients over `num_micro_batches` slices of `batch`.

    `loss_and_grad_fn(params, micro_batch) -> ((loss_sum, num_tokens), grads_of_loss_sum)`
    must return the loss *summed* over the micro-batch's counted tokens, their count, and the
    gradient of that sum. Summing the three over micro-batches and dividing by the total count
    gives the token-mean loss and its gradient over the whole batch, the same as one step on
    the whole batch up to float summation order, however the tokens fall across micro-batches
    (a mean of per-micro-batch means would weight short micro-batches too much).

    Args:
      loss_and_grad_fn: as above. `params` is passed through untouched, so it may be a pytree
        of arrays (an `nnx.State`) or an `nnx.Module` that the function differentiates with
        `nnx.value_and_grad` (it must not mutate the module).
      params: the first argument of `loss_and_grad_fn`.
      batch: dict of arrays with a common leading batch dim B (`tokens`, `segment_ids`, ...).
      num_micro_batches: k; B must be divisible by k (and B/k by the 'data' axis size when
        sharded). k == 1 calls the function once, without a loop.
      batch_spec: the batch arrays' PartitionSpec (e.g. `P('data', None)`) under an explicit
        mesh; each micro-batch then keeps the batch sharding on its leading dim.


      The function may also return `((loss_sum, (num_tokens, sums)), grads)`, `sums` a dict of
      arrays summed over micro-batches (token-weighted metrics such as an MoE
      load-balancing loss times the token count); they come back divided by the count.

    Returns:
      Accumulated(loss_sum / tokens, the total token count, the gradient of the mean loss (a
      pytree like `loss_and_grad_fn`'s gradients), the sums divided by the token count).
    """
    inner = loss_and_grad_fn

    def loss_and_grad_fn(p, b):
        (loss, aux), grads = inner(p, b)
        tokens, sums = aux if isinstance(aux, tuple) else (aux, {})
        return (loss, (tokens, sums)), grads

    if num_micro_batches < 1:
        raise UsageError(f"num_micro_batches must be >= 1, got {num_micro_batches}")
    if num_micro_batches == 1:
        (loss_sum, (num_tokens, sums)), grads_sum = loss_and_grad_fn(params, batch)
    else:
        micro_batches = {
            name: _split_micro_batches(x, num_micro_batches, batch_spec)
            for name, x in batch.items()
        }

        # Rebuilt inside the loop body: an nnx.Module closed over as is belongs to the outer
        # trace, and nnx transforms in the body refuse it ("different trace level"); rebuilt
        # from its leaves it is a fresh pytree whose leaves JAX closes over as constants.
        param_leaves, param_treedef = jax.tree.flatten(params)

        def body(carry, micro_batch):
            loss_sum, num_tokens, sums, grads_sum = carry
            params_here = jax.tree.unflatten(param_treedef, param_leaves)
            (loss, (tokens, more)), grads = loss_and_grad_fn(params_here, micro_batch)
            grads_sum = jax.tree.map(jnp.add, grads_sum, grads)
            sums = jax.tree.map(jnp.add, sums, more)
            return (loss_sum + loss, num_tokens + tokens, sums, grads_sum), None

        # Zeros with the gradients' shapes, dtypes and (explicit-mesh) shardings, so the scan
        # carry has one type throughout; eval_shape traces the function but computes nothing.
        first = jax.tree.map(lambda x: x[0], micro_batches)
        (loss_shape, (tokens_shape, sums_shape)), grads_shape = jax.eval_shape(
            loss_and_grad_fn, params, first
        )
        init = (
            jnp.zeros(loss_shape.shape, loss_shape.dtype),
            jnp.zeros(tokens_shape.shape, tokens_shape.dtype),
            jax.tree.map(jnp.zeros_like, sums_shape),
            jax.tree.map(jnp.zeros_like, grads_shape),
        )
        (loss_sum, num_tokens, sums, grads_sum), _ = jax.lax.scan(body, init, micro_batches)
    # max(., 1): a batch of padding only has no tokens; its loss and gradients are then 0.
    denom = jnp.maximum(num_tokens, 1).astype(jnp.float32)
    mean_loss = loss_sum / denom
    grads = jax.tree.map(lambda g: (g / denom).astype(g.dtype), grads_sum)
    return Accumulated(mean_loss, num_tokens, grads, jax.tree.map(lambda x: x / denom, sums))
