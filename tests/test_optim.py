"""Tests for nnx_zoo/training/optim.py: schedule, clipping, the weight-decay mask,
micro-batching."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from nnx_zoo.training.optim import accumulate_gradients, make_optimizer

VOCAB, DIM, LAYERS = 11, 4, 3


class TinyLm(nnx.Module):
    """Parameter names like the zoo's: embed, stacked norms and kernels, a bias, an lm head."""

    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.normal(1.0)
        self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)
        # Stacked layers: leading layer axis, so the norm scale is 2-D and only its name tells.
        self.attn_norm = nnx.Param(1.0 + init(rngs.params(), (LAYERS, DIM)))
        self.q_kernel = nnx.Param(init(rngs.params(), (LAYERS, DIM, DIM)))
        self.proj = nnx.Linear(DIM, DIM, bias_init=nnx.initializers.constant(0.5), rngs=rngs)
        self.final_norm = nnx.RMSNorm(DIM, rngs=rngs)
        self.lm_head = nnx.Linear(DIM, VOCAB, use_bias=False, rngs=rngs)

    def __call__(self, tokens_BT):
        # One-hot matmul rather than a gather: under an explicit mesh it takes the batch
        # sharding from the tokens without an out_sharding argument.
        x_BTM = jnp.einsum("BTV,VM->BTM", jax.nn.one_hot(tokens_BT, VOCAB), self.embed.embedding)
        for layer in range(LAYERS):
            h_BTM = x_BTM * self.attn_norm[layer]
            x_BTM = x_BTM + jnp.tanh(jnp.einsum("BTM,MN->BTN", h_BTM, self.q_kernel[layer]))
        x_BTM = x_BTM + self.proj(x_BTM)
        return self.lm_head(self.final_norm(x_BTM))


DECAYED = {"q_kernel", "proj/kernel", "lm_head/kernel"}
NOT_DECAYED = {"embed/embedding", "attn_norm", "proj/bias", "final_norm/scale"}


def _flat_params(model):
    """'a/b' path -> numpy array, for every nnx.Param (dropping the trailing '.value')."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]:
        names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
        out["/".join(n for n in names if n != "value")] = np.asarray(leaf)
    return out


@pytest.mark.parametrize("decay_all", [False, True])
def test_weight_decay_mask_through_nnx_optimizer(decay_all):
    # Zero gradients make Adam's step exactly 0, so the only change is decoupled weight
    # decay: p <- p * (1 - lr * wd) where decayed, p unchanged elsewhere.
    lr, wd = 0.5, 0.1
    model = TinyLm(nnx.Rngs(0))
    tx, schedule = make_optimizer(
        learning_rate=lr,
        warmup_steps=0,
        total_steps=10,
        weight_decay=wd,
        decay_norms_and_embeddings=decay_all,
    )
    assert float(schedule(0)) == pytest.approx(lr)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    before = _flat_params(model)
    assert set(before) == DECAYED | NOT_DECAYED
    zero_grads = jax.tree.map(jnp.zeros_like, nnx.state(model, nnx.Param))
    optimizer.update(model, zero_grads)
    after = _flat_params(model)
    for name in DECAYED | NOT_DECAYED:
        decayed = decay_all or name in DECAYED
        expected = before[name] * (1 - lr * wd) if decayed else before[name]
        np.testing.assert_allclose(after[name], expected, rtol=1e-6, err_msg=name)
        assert decayed == (not np.array_equal(after[name], before[name])), name


def test_schedule_warmup_then_cosine():
    _, schedule = make_optimizer(
        learning_rate=1e-3, warmup_steps=10, total_steps=110, end_learning_rate_ratio=0.1
    )
    assert float(schedule(0)) == 0.0
    assert float(schedule(5)) == pytest.approx(5e-4)
    assert float(schedule(10)) == pytest.approx(1e-3)
    # Cosine half-way through the decay: end + (peak - end) / 2.
    assert float(schedule(60)) == pytest.approx(1e-4 + 0.45e-3, rel=1e-5)
    assert float(schedule(110)) == pytest.approx(1e-4)
    assert float(schedule(500)) == pytest.approx(1e-4)


def test_global_norm_clipping_precedes_adam():
    # Adam's first moment after one step is (1 - b1) * g_clipped; g has global norm 5.
    b1, clip = 0.9, 1.0
    tx, _ = make_optimizer(
        learning_rate=1e-3, warmup_steps=0, total_steps=10, b1=b1, clip_grad_norm=clip
    )
    params = {"w": jnp.ones((2, 2)), "v": jnp.ones((1,))}
    grads = {"w": jnp.full((2, 2), 2.0), "v": jnp.array([3.0])}  # norm sqrt(16 + 9) = 5
    _, state = tx.update(grads, tx.init(params), params)
    adam_states = [
        s
        for s in jax.tree.leaves(state, is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState))
        if isinstance(s, optax.ScaleByAdamState)
    ]
    assert len(adam_states) == 1
    np.testing.assert_allclose(adam_states[0].mu["w"], (1 - b1) * 2.0 / 5.0, rtol=1e-6)
    np.testing.assert_allclose(adam_states[0].mu["v"], (1 - b1) * 3.0 / 5.0, rtol=1e-6)


def test_bad_schedule_lengths_raise():
    with pytest.raises(ValueError, match="warmup_steps"):
        make_optimizer(learning_rate=1e-3, warmup_steps=20, total_steps=10)
    with pytest.raises(ValueError, match="warmup_steps"):
        make_optimizer(learning_rate=1e-3, warmup_steps=10, total_steps=10)


# --- gradient accumulation ---------------------------------------------------------------


def _loss_sum(model, batch):
    """Cross-entropy summed over counted tokens (same segment, not padding) and their count."""
    tokens_BT, seg_BT = batch["tokens"], batch["segment_ids"]
    logits_BTV = model(tokens_BT)[:, :-1]
    mask_BT = (seg_BT[:, 1:] == seg_BT[:, :-1]) & (seg_BT[:, 1:] != 0)
    ce_BT = optax.softmax_cross_entropy_with_integer_labels(logits_BTV, tokens_BT[:, 1:])
    return jnp.sum(ce_BT * mask_BT), jnp.sum(mask_BT).astype(jnp.int32)


def _loss_and_grad(model, batch):
    (loss_sum, num_tokens), grads = nnx.value_and_grad(_loss_sum, has_aux=True)(model, batch)
    return (loss_sum, num_tokens), grads


def _batch(batch_size, seq_len=8, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, (batch_size, seq_len), dtype=np.int32)
    # Very different amounts of padding per row, so micro-batches hold different token counts
    # and an unweighted mean of micro-batch means would be wrong.
    lengths = rng.integers(2, seq_len + 1, batch_size)
    lengths[::3] = 2
    seg = (np.arange(seq_len)[None, :] < lengths[:, None]).astype(np.int32)
    seg[1, 5:] = 2  # a second document in one row
    return {"tokens": tokens, "segment_ids": seg}


def _reference(model, batch):
    """jax.grad of the whole batch's token-mean loss, without accumulate_gradients."""

    def mean_loss(m):
        loss_sum, num_tokens = _loss_sum(m, batch)
        return loss_sum / num_tokens

    return nnx.value_and_grad(mean_loss)(model)


def _assert_trees_close(a, b, atol):
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(leaves_a) == len(leaves_b) > 0
    for x, y in zip(leaves_a, leaves_b, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=atol)


# atol 1e-6: the same float32 sums in another order (per micro-batch, then across them).
ATOL = 1e-6


@pytest.mark.parametrize("num_micro_batches", [1, 4])
def test_accumulated_gradients_equal_big_batch(num_micro_batches):
    model = TinyLm(nnx.Rngs(1))
    batch = {k: jnp.asarray(v) for k, v in _batch(8).items()}
    ref_loss, ref_grads = _reference(model, batch)

    step = jax.jit(accumulate_gradients, static_argnums=(0, 3))
    loss, num_tokens, grads, _ = step(_loss_and_grad, model, batch, num_micro_batches)
    assert int(num_tokens) == int(_loss_sum(model, batch)[1])
    np.testing.assert_allclose(loss, ref_loss, rtol=0, atol=ATOL)
    _assert_trees_close(grads, ref_grads, ATOL)


def test_unweighted_mean_of_micro_batches_would_differ():
    # Guards the test above: with these batches, averaging per-micro-batch means (the usual
    # mistake) is far outside the tolerance, so the weighting is really being tested.
    model = TinyLm(nnx.Rngs(1))
    batch = _batch(8)
    ref_loss, _ = _reference(model, batch)
    means = []
    for j in range(4):
        loss_sum, num_tokens = _loss_sum(model, {k: v[j::4] for k, v in batch.items()})
        means.append(loss_sum / num_tokens)
    assert abs(float(np.mean(means)) - float(ref_loss)) > 100 * ATOL


def test_accumulation_with_functional_params():
    # The loop may split the model and differentiate a pure function of an nnx.State.
    model = TinyLm(nnx.Rngs(2))
    graphdef, params = nnx.split(model, nnx.Param)

    def loss_and_grad(p, batch):
        return jax.value_and_grad(lambda p: _loss_sum(nnx.merge(graphdef, p), batch), has_aux=True)(
            p
        )

    batch = _batch(8, seed=3)
    ref_loss, ref_grads = _reference(model, batch)
    loss, _, grads, _ = jax.jit(lambda p, b: accumulate_gradients(loss_and_grad, p, b, 2))(
        params, batch
    )
    np.testing.assert_allclose(loss, ref_loss, rtol=0, atol=ATOL)
    _assert_trees_close(grads, ref_grads, ATOL)


def test_accumulation_under_explicit_data_sharding():
    assert len(jax.devices()) == 8, "conftest.py must force 8 CPU devices"
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    batch_np = _batch(32, seed=4)  # B=32, k=4: 8 rows per micro-batch, 1 per device
    model_1dev = TinyLm(nnx.Rngs(5))
    ref_loss, ref_grads = _reference(model_1dev, batch_np)
    micro_batch_specs = []

    def loss_and_grad(model, batch):
        micro_batch_specs.append(jax.typeof(batch["tokens"]).sharding.spec)
        return _loss_and_grad(model, batch)

    with jax.set_mesh(mesh):
        model = TinyLm(nnx.Rngs(5))  # replicated parameters
        spec = P("data", None)
        batch = {k: jax.device_put(v, spec) for k, v in batch_np.items()}
        step = jax.jit(lambda m, b: accumulate_gradients(loss_and_grad, m, b, 4, batch_spec=spec))
        loss, _, grads, _ = step(model, batch)
    # Each micro-batch kept its rows on their devices: no gather of the batch.
    assert micro_batch_specs and all(s == P("data", None) for s in micro_batch_specs)
    np.testing.assert_allclose(loss, ref_loss, rtol=0, atol=ATOL)
    _assert_trees_close(grads, ref_grads, ATOL)


def test_indivisible_batch_raises():
    model = TinyLm(nnx.Rngs(0))
    with pytest.raises(ValueError, match="not divisible"):
        accumulate_gradients(_loss_and_grad, model, _batch(6), 4)
