"""Context parallelism: the balanced chunk order, its causal load balance, the T checks, and
the activation memory a split T saves. (Equality with the one-device run, fsdp_cp with
context 2 and 4 and fsdp_tp_cp, is in test_strategies_equal_one_device.py.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from model_utils import put_batch

from nnx_zoo.training.loop import Trainer
from nnx_zoo.training.step_memory import step_memory
from shardings import check_batch, get_strategy
from zoo import create_model, get_config
from zoo.layers.attention import Segments, attention_mask, context_parallel


@pytest.mark.parametrize("context", [2, 4])
def test_reorder_is_the_balanced_permutation_and_back(context):
    mesh = get_strategy("fsdp_cp").make_mesh(shape=(8 // context, context))
    x_BTM = np.arange(8 * 32 * 3, dtype=np.float32).reshape(8, 32, 3)
    order = context_parallel.balanced_order(32, context)
    # Device i holds chunks i and 2c-1-i of the 2c chunks.
    chunk = 32 // (2 * context)
    assert list(order[:chunk]) == list(range(chunk))
    assert list(order[chunk : 2 * chunk]) == list(range(32 - chunk, 32))
    with jax.set_mesh(mesh):
        x = jax.device_put(jnp.asarray(x_BTM), jax.sharding.PartitionSpec("data", "context"))
        balanced = jax.jit(lambda x: context_parallel.to_balanced(x, "context"))(x)
        back = jax.jit(lambda x: context_parallel.from_balanced(x, "context"))(balanced)
    np.testing.assert_array_equal(np.asarray(balanced), x_BTM[:, order])
    np.testing.assert_array_equal(np.asarray(back), x_BTM)


def _one_document_rows(batch, seq):
    seg = np.ones((batch, seq), np.int32)
    return seg, np.tile(np.arange(seq, dtype=np.int32), (batch, 1))


@pytest.mark.parametrize("context", [2, 4])
def test_causal_work_is_balanced_over_context_devices(context):
    # One causal document per row, the case the chunk order is for. (In packed rows the
    # per-device work also depends on where documents start: the order cannot fix that.)
    seg, pos = _one_document_rows(4, 1024)
    counts = np.asarray(visible_pairs_per_device(seg, pos, context))
    spread = np.abs(counts - counts.mean()).max() / counts.mean()
    assert spread <= 0.10, f"query-key pairs per device {counts.tolist()}"
    # The same count over contiguous slices is far from balanced: the check can fail.
    T, per = seg.shape[1], seg.shape[1] // context
    contiguous = (
        np.asarray([sum(t + 1 for t in range(i * per, (i + 1) * per)) for i in range(context)])
        * seg.shape[0]
    )
    assert contiguous.sum() == counts.sum() == seg.shape[0] * T * (T + 1) // 2
    assert np.abs(contiguous - contiguous.mean()).max() / contiguous.mean() > 0.4


def test_sequence_length_must_split_into_balanced_chunks():
    mesh = get_strategy("fsdp_cp").make_mesh(shape=(2, 4))
    spec = get_strategy("fsdp_cp").batch_spec()
    check_batch(4, spec, mesh, "fsdp_cp", seq_len=64)
    with pytest.raises(ValueError, match=r"sequence length 60 .* multiple of 8"):
        check_batch(4, spec, mesh, "fsdp_cp", seq_len=60)


def _train_step_temp_bytes(context: int, seq_len: int) -> int:
    """Compiled temp bytes per device of one train step (forward, backward, AdamW) of the
    tiny model at global batch 2 x seq_len, on data:2 x context:`context` devices."""
    cfg = get_config("tiny", remat="full")
    strategy = get_strategy("fsdp_cp")
    mesh = strategy.make_mesh(shape=(2, context), devices=jax.devices()[: 2 * context])
    with jax.set_mesh(mesh):
        model = create_model(cfg, strategy, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
        trainer = Trainer(model, optimizer, batch_spec=strategy.batch_spec())
        seg, pos = _one_document_rows(2, seq_len)
        batch = {"tokens": pos % cfg.vocab_size, "segment_ids": seg, "positions": pos}
        trainer.compile(put_batch(batch, strategy.batch_spec()))
        return step_memory(trainer.compiled).temp_bytes


def test_context_axis_cuts_activation_memory_at_long_sequence():
    one = _train_step_temp_bytes(context=1, seq_len=8192)
    four = _train_step_temp_bytes(context=4, seq_len=8192)
    print(f"\ntemp bytes per device, T=8192, global batch 2: context 1 {one}, context 4 {four}")
    assert four <= 0.4 * one, (one, four)


def visible_pairs_per_device(segment_ids_BT, positions_BT, context: int, *, window=None):
    """Query-key pairs each context device's mask lets through, summed over the batch, in
    the balanced layout: the mask each device builds is its own T/c queries against all T
    keys (as `attention` gathers them). numpy in, list of c ints out."""
    T = segment_ids_BT.shape[1]
    order = context_parallel.balanced_order(T, context)
    seg, pos = jnp.asarray(segment_ids_BT)[:, order], jnp.asarray(positions_BT)[:, order]
    per = T // context
    counts = []
    for i in range(context):
        mask = attention_mask(
            Segments(seg[:, i * per : (i + 1) * per], seg, pos[:, i * per : (i + 1) * per], pos),
            causal=True,
            sliding_window=window,
        )
        counts.append(int(jnp.sum(mask)))
    return counts
