"""LoRA numerics and layouts (issue 30, check 3): a zero B gives exactly the base logits; after
training the adapted model equals the merged one; every strategy trains as one device does;
only the adapters train (the base and its optimizer state stay out)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from model_utils import one_device_mesh, packed_batch

from nnx_zoo.training.loop import Trainer, loss_sum
from shardings import STRATEGIES, get_strategy
from zoo import create_model, get_config
from zoo.layers import pipeline
from zoo.layers.lora import TARGETS, LoraConfig, LoraParam, adapters, add_lora, merge_lora

CFG = get_config("tiny")
LORA = LoraConfig(rank=4, alpha=8.0, targets=tuple(TARGETS))
BATCH = packed_batch(batch=8, seq=32)
STEPS = 2


def _make(strategy):
    model = create_model(CFG, strategy, rngs=nnx.Rngs(0))
    add_lora(model, LORA, nnx.Rngs(1))
    return model


def _build(mesh, strategy, values=None):
    """The model with adapters under `strategy`: initialised, or with `values` ({path:
    array}, e.g. the one-device model's) laid out as the strategy declares them, which
    skips the initialiser's compile (the slowest part of a case)."""
    with jax.set_mesh(mesh):
        if values is None:
            return _make(strategy)
        graphdef, state = nnx.split(nnx.eval_shape(lambda: _make(strategy)))
        flat = nnx.to_flat_state(state)
        for path, var in flat:
            spec = var.get_value().sharding.spec
            var.set_value(jax.device_put(values[path], jax.NamedSharding(mesh, spec)))
        return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _values(model):
    return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model))}


def _put(mesh, strategy):
    return {
        k: jax.device_put(jnp.asarray(v), jax.NamedSharding(mesh, strategy.batch_spec()))
        for k, v in BATCH.items()
    }


def _logits(model, batch):
    return nnx.jit(
        lambda m, b: m(b["tokens"], segment_ids=b["segment_ids"], positions=b["positions"])
    )(model, batch)


def _train(mesh, strategy, values=None):
    """(model after STEPS SGD steps on the adapters (linear in the gradients, so the
    strategies' rounding differences stay that small), losses, base params before/after)."""
    model = _build(mesh, strategy, values)
    batch = _put(mesh, strategy)
    with jax.set_mesh(mesh):
        base_before = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
        initial = _values(model)
        optimizer = nnx.Optimizer(model, optax.sgd(0.5), wrt=LoraParam)
        # Under a pipeline strategy the trainer runs the schedule of the model's plan.
        pp = pipeline.plan_for(model.cfg, strategy.lm_sharding(), mesh)
        trainer = Trainer(
            model, optimizer, batch_spec=strategy.batch_spec(), wrt=LoraParam, pipeline=pp
        )
        losses = [float(trainer.train_step(batch)["loss"]) for _ in range(STEPS)]
        model, optimizer = trainer.sync()
    return model, optimizer, losses, base_before, batch, initial


@pytest.fixture(scope="module")
def one_device():
    mesh = one_device_mesh()
    return mesh, _train(mesh, get_strategy("dp"))


def test_zero_b_gives_exactly_the_base_logits():
    mesh, strategy = one_device_mesh(), get_strategy("dp")
    batch = _put(mesh, strategy)
    with jax.set_mesh(mesh):
        model = create_model(CFG, strategy, rngs=nnx.Rngs(0))
        base = np.asarray(_logits(model, batch))
        add_lora(model, LORA, nnx.Rngs(1))
        adapted = np.asarray(_logits(model, batch))
        # Every adapter adds exactly zero, (x A) B with B = 0, while A is random.
        for _, module in adapters(model):
            assert not np.any(np.asarray(module.lora.b[...]))
            assert np.all(np.asarray(module.lora.a[...]) != 0)
    # The adapted step is another program (it adds the adapters' dots), and XLA CPU may pick
    # another kernel or fusion for the base dots beside them: on CI's host that rounded the
    # logits differently by a few float32 ulps. Equal within that, not bit for bit.
    np.testing.assert_allclose(adapted, base, rtol=1e-6, atol=1e-6)


def test_only_adapters_train_and_adapted_equals_merged(one_device):
    mesh, (model, optimizer, losses, base_before, batch, _) = one_device
    assert losses[-1] < losses[0]
    with jax.set_mesh(mesh):
        base_after = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
        jax.tree.map(np.testing.assert_array_equal, base_before, base_after)
        # Adam's moments cover the adapters only: nothing the size of the base.
        adam = nnx.Optimizer(model, optax.adam(1e-3), wrt=LoraParam)
        moments = jax.tree.leaves(nnx.state(adam, nnx.optimizer.OptState))
        adapter_size = sum(x.size for x in jax.tree.leaves(nnx.state(model, LoraParam)))
        assert sum(x.size for x in moments) == 2 * adapter_size + 2  # + step counts
        b = model.blocks.attention.q.lora.b[...]
        assert float(jnp.abs(b).max()) > 0  # trained away from zero
        adapted = np.asarray(_logits(model, batch))
        merged_model = nnx.clone(model)
        merge_lora(merged_model)
        assert not nnx.state(merged_model, LoraParam)
        merged = np.asarray(_logits(merged_model, batch))
    # float32: W x + s (x A) B vs (W + s A B) x differ by rounding of the reassociation.
    np.testing.assert_allclose(adapted, merged, atol=2e-5, rtol=1e-5)


# Every strategy, each axis of its mesh split (8 devices): the adapters take each table's
# layouts, and the pipelines' stage split of L.
CASES = {
    "dp": (8,),
    "fsdp": (8,),
    "tp": (4, 2),
    "fsdp_tp": (4, 2),
    "tp_sp": (4, 2),
    "fsdp_tp_sp": (4, 2),
    "hsdp": (2, 4),
    "hsdp_tp": (2, 2, 2),
    "fsdp_cp": (4, 2),
    "fsdp_tp_cp": (2, 2, 2),
    "fsdp_ep": (4, 2),
    "fsdp_tp_ep": (2, 2, 2),
    "fsdp_pp": (2, 4),
    "fsdp_tp_pp": (2, 2, 2),
    "fsdp_ep_pp": (2, 2, 2),
}


def test_every_strategy_has_a_case():
    assert set(CASES) == set(STRATEGIES)


@pytest.mark.parametrize("name", list(CASES))
def test_every_strategy_equals_one_device(name, one_device):
    _, (ref_model, _, ref_losses, _, _, initial) = one_device
    strategy = get_strategy(name)
    mesh = strategy.make_mesh(shape=CASES[name])
    model, _, losses, _, _, _ = _train(mesh, strategy, initial)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    ref = nnx.to_flat_state(nnx.state(ref_model, LoraParam))
    got = dict(nnx.to_flat_state(nnx.state(model, LoraParam)))
    for path, var in ref:
        # float32 SGD steps from identical starts; reductions split over devices differ
        # in rounding only.
        np.testing.assert_allclose(
            np.asarray(got[path][...]), np.asarray(var[...]), atol=1e-5, rtol=1e-4
        )
    # A follows its base matrix's input dims, B the output dims (fsdp_tp: M/data, N/model),
    # both the L split (stage, under a pipeline).
    q, o = model.blocks.attention.q, model.blocks.attention.o
    w_q, a_q, b_q = (_spec(x, 4) for x in (q.weight, q.lora.a, q.lora.b))
    assert a_q[:3] == (w_q[0], w_q[1], None)  # [L, M, R]
    assert b_q == (w_q[0], None, w_q[2], w_q[3])  # [L, R, N, D]
    w_o, a_o, b_o = (_spec(x, 4) for x in (o.weight, o.lora.a, o.lora.b))
    assert a_o == (w_o[0], w_o[1], w_o[2], None)  # [L, N, D, R]
    assert b_o[:3] == (w_o[0], None, w_o[3])  # [L, R, M]
    split = any(a is not None for a in (*w_q, *w_o))
    assert split == (name != "dp"), name


def _spec(var, rank):
    return (tuple(jax.typeof(var[...]).sharding.spec) + (None,) * rank)[:rank]


def test_a_target_that_names_no_module_is_one_line():
    # Qwen3-MoE's blocks have experts where a dense MLP's gate would be.
    mesh, strategy = one_device_mesh(), get_strategy("dp")
    with jax.set_mesh(mesh):
        model = create_model(get_config("qwen3-moe-tiny"), strategy, rngs=nnx.Rngs(0))
        with pytest.raises(ValueError, match="'gate' names no module of this model") as e:
            add_lora(model, LoraConfig(rank=2, alpha=2.0, targets=("q_proj", "gate")), nnx.Rngs(0))
    assert "\n" not in str(e.value) and "valid here: q_proj, k_proj, v_proj, o_proj" in str(e.value)


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(rank=0, alpha=8.0), "lora.rank=0: must be an integer > 0"),
        (dict(rank=4, alpha=8.0, targets=("q_proj", "mlp")), "unknown mlp; valid: q_proj"),
        (dict(rank=4, alpha=8.0, dropout=1.0), "lora.dropout=1.0"),
    ],
)
def test_bad_lora_config_is_one_line(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        LoraConfig(**kwargs)


def test_dropout_trains_and_evaluation_is_deterministic():
    mesh, strategy = one_device_mesh(), get_strategy("dp")
    batch = _put(mesh, strategy)
    with jax.set_mesh(mesh):
        model = create_model(CFG, strategy, rngs=nnx.Rngs(0))
        config = LoraConfig(rank=4, alpha=8.0, dropout=0.5, targets=("q_proj", "up"))
        add_lora(model, config, nnx.Rngs(params=1, dropout=2))
        optimizer = nnx.Optimizer(model, optax.sgd(0.5), wrt=LoraParam)
        trainer = Trainer(model, optimizer, batch_spec=strategy.batch_spec(), wrt=LoraParam)
        for _ in range(2):
            assert np.isfinite(float(trainer.train_step(batch)["loss"]))
        evaluated, _ = trainer.eval_step(batch)
        model, _ = trainer.sync()
        merged = nnx.clone(model)
        merge_lora(merged)  # no adapters, so no dropout
        want, _ = nnx.jit(loss_sum)(merged, batch)
    # Were dropout on in evaluation, half the adapters' inputs would be gone: far apart.
    np.testing.assert_allclose(float(evaluated), float(want), rtol=1e-5)


def test_dropout_under_a_pipeline_is_one_line():
    strategy = get_strategy("fsdp_pp")
    with jax.set_mesh(strategy.make_mesh(shape=(2, 4))):
        model = nnx.eval_shape(lambda: create_model(CFG, strategy, rngs=nnx.Rngs(0)))
        with pytest.raises(ValueError, match="lora.dropout=0.1 does not run under a pipeline") as e:
            add_lora(model, LoraConfig(rank=2, alpha=2.0, dropout=0.1), nnx.Rngs(0))
    assert "\n" not in str(e.value)
