"""The LM head fused with the loss over token chunks equals the full-logits path.

The full-logits path (`zoo.loss.token_nll` on `[B, T, V]` logits, `loss_chunk_size=0`) is
the reference. Float32 throughout. Both paths compute the same logits and reductions; what
differs is summation order (the head gradient sums tokens chunk by chunk, then across
chunks; XLA may tile the smaller matmuls differently). Measured here: every difference is
at most 7e-7 of the largest entry of its array. RTOL / ATOL_FRACTION leave a >10x margin
and are far below what a wrong mask, a dropped shard or a missed soft-cap moves (>1e-2
relative).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from model_utils import one_device_mesh, packed_batch, put_batch

from nnx_zoo.launch.build import abstract_run
from nnx_zoo.training.step_memory import step_memory
from shardings import get_strategy
from zoo import create_model, get_config
from zoo.lm_head_loss import Head, chunk_positions, chunked_token_nll, head_logits
from zoo.loss import target_mask, token_nll

RTOL = 1e-5
ATOL_FRACTION = 1e-5  # absolute tolerance, as a fraction of the largest reference entry

LAYOUTS = {
    "dp, 1 device": ("dp", None),
    "fsdp_tp (4,2), V/model": ("fsdp_tp", (4, 2)),
    "fsdp_cp (4,2), T/context": ("fsdp_cp", (4, 2)),
}
HEADS = {
    "untied": dict(tied=False, softcap=None),
    "tied, soft-capped": dict(tied=True, softcap=0.5),
}


def _mesh(strategy_name, shape):
    strategy = get_strategy(strategy_name)
    if shape is None:
        return strategy, one_device_mesh()
    return strategy, strategy.make_mesh(shape=shape)


def _close(got, ref):
    got, ref = np.asarray(got), np.asarray(ref)
    atol = ATOL_FRACTION * max(np.abs(ref).max(), 1e-30)
    np.testing.assert_allclose(got, ref, rtol=RTOL, atol=atol)


@pytest.mark.parametrize("head", list(HEADS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_chunked_nll_and_grads_equal_full_logits(layout, head):
    """Loss and gradients with respect to the final hidden state and the head weight (or,
    tied, the embedding table), on packed rows with padding and document ends masked."""
    strategy, mesh = _mesh(*LAYOUTS[layout])
    tied, softcap = HEADS[head]["tied"], HEADS[head]["softcap"]
    B, T, M, V = 8, 40, 32, 256
    rng = np.random.default_rng(0)
    batch = packed_batch(batch=B, seq=T, vocab=V, seed=1)
    x_np = 3.0 * rng.standard_normal((B, T, M)).astype(np.float32)
    w_shape = (V, M) if tied else (M, V)
    w_np = 0.02 * rng.standard_normal(w_shape).astype(np.float32)
    lm = strategy.lm_sharding()
    with jax.set_mesh(mesh):
        x = jax.device_put(x_np, lm.final_norm.out)
        w = jax.device_put(w_np, lm.embed.table if tied else lm.lm_head.weight)
        b = put_batch(batch, lm.tokens)
        targets, mask = target_mask(b["tokens"], b["segment_ids"])

        head = Head(tied=tied, dtype=jnp.float32, out_spec=lm.lm_head.out, softcap=softcap)

        def full(x, w):
            nll, m = token_nll(head.logits(x, w), b["tokens"], b["segment_ids"])
            return jnp.sum(nll) / jnp.sum(m)

        # 8 positions per chunk whatever the rows per device: under fsdp_tp 5 chunks; under
        # fsdp_cp each device walks its 20 positions in 3 chunks, the last padded.
        chunk_size = 8 * B // mesh.shape["data"]
        assert chunk_positions(x, chunk_size) == 8

        def chunked(x, w):
            nll = chunked_token_nll(x, w, targets, mask, head, chunk_size)
            return jnp.sum(nll) / jnp.sum(mask)

        grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1)))  # noqa: E731
        ref_loss, (ref_dx, ref_dw) = grad(full)(x, w)
        loss, (dx, dw) = grad(chunked)(x, w)
        # The gradients keep the layouts of what they differentiate.
        assert jax.typeof(dw).sharding.spec == jax.typeof(w).sharding.spec
        assert jax.typeof(dx).sharding.spec == jax.typeof(x).sharding.spec
    _close(loss, ref_loss)
    _close(dx, ref_dx)
    _close(dw, ref_dw)
    # Masked positions (padding, each document's last token) get no gradient at all.
    dx_masked = np.asarray(dx)[~np.asarray(mask)]
    assert dx_masked.size and np.all(dx_masked == 0)
    # Guards the comparison: the soft-cap is in its non-linear range, so skipping it would
    # show; and the gradients are far from zero.
    if softcap:
        raw = np.einsum("btm,vm->btv", x_np, w_np)
        assert np.abs(raw).max() > softcap
    assert np.abs(np.asarray(ref_dw)).max() > 1e-3


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_head_gradients_equal_jax_transpose_rule(layout):
    """`head_logits` computes its weight gradient by its own rule (a dot of (x, g), in the
    weight's dim order); both references above go through it, so here it meets the plain
    einsum differentiated by JAX, tied and untied, on a sequence-split 4-D chunk too."""
    strategy, mesh = _mesh(*LAYOUTS[layout])
    B, T, M, V = 8, 16, 32, 256
    rng = np.random.default_rng(3)
    x_np = rng.standard_normal((B, T, M)).astype(np.float32)
    g_np = rng.standard_normal((B, T, V)).astype(np.float32)
    lm = strategy.lm_sharding()
    for tied in (False, True):
        w_np = 0.1 * rng.standard_normal((V, M) if tied else (M, V)).astype(np.float32)
        eq = "...M,VM->...V" if tied else "...M,MV->...V"
        with jax.set_mesh(mesh):
            x = jax.device_put(x_np, lm.final_norm.out)
            w = jax.device_put(w_np, lm.embed.table if tied else lm.lm_head.weight)
            g = jax.device_put(g_np, lm.lm_head.out)
            if layout.startswith("fsdp_cp"):  # the chunk form of a T split: [B, S, C, .]
                spec = tuple(lm.final_norm.out)
                x, g = (
                    jnp.reshape(a, (B, 2, T // 2, a.shape[-1]), out_sharding=P(*spec[:2], None))
                    for a in (x, g)
                )

            def ours(x, w, g, tied=tied):
                out = head_logits(
                    x, w, tied=tied, dtype=jnp.float32, out_spec=lm.lm_head.out, softcap=None
                )
                return jnp.sum(out * g)

            def plain(x, w, g, eq=eq):
                return jnp.sum(jnp.einsum(eq, x, w) * g)

            got = jax.jit(jax.grad(ours, argnums=(0, 1)))(x, w, g)
            ref = jax.jit(jax.grad(plain, argnums=(0, 1)))(x, w, g)
            assert jax.typeof(got[1]).sharding.spec == jax.typeof(w).sharding.spec
        for a, b in zip(got, ref, strict=True):
            _close(a, b)


MODELS = {
    "fsdp_tp (4,2), tied, soft-capped": (
        "fsdp_tp",
        (4, 2),
        dict(tie_embeddings=True, final_logit_softcap=0.5),
    ),
}


@pytest.mark.parametrize("case", list(MODELS))
def test_model_chunked_loss_and_param_grads_equal_full_logits(case):
    """`model.token_nll(..., chunk_size)` against `chunk_size=0`: every parameter's gradient,
    the LM head or the tied embedding included."""
    strategy_name, shape, overrides = MODELS[case]
    strategy, mesh = _mesh(strategy_name, shape)
    cfg = get_config("tiny", **overrides)
    batch = packed_batch(batch=8, seq=40, vocab=cfg.vocab_size, seed=2)
    with jax.set_mesh(mesh):
        model = create_model(cfg, strategy, rngs=nnx.Rngs(0))
        b = put_batch(batch, strategy.batch_spec())
        graphdef, state = nnx.split(model)

        def loss(state, chunk_size):
            m = nnx.merge(graphdef, state)
            nll, mask, _ = m.token_nll(
                b["tokens"],
                segment_ids=b["segment_ids"],
                positions=b["positions"],
                chunk_size=chunk_size,
            )
            return jnp.sum(nll) / jnp.sum(mask)

        step = jax.jit(jax.value_and_grad(loss), static_argnums=1)
        ref_loss, ref_grads = step(state, 0)
        loss_val, grads = step(state, 8 * 8 // mesh.shape["data"])  # 8 positions per chunk
    _close(loss_val, ref_loss)
    ref_leaves, leaves = jax.tree.leaves(ref_grads), jax.tree.leaves(grads)
    assert len(leaves) == len(ref_leaves)
    for got, ref in zip(leaves, ref_leaves, strict=True):
        _close(got, ref)


# Check 3: a Llama-3-sized vocabulary on a small model, where the logits dominate.
BIG_VOCAB = dict(vocab_size=128_256, hidden_dim=512, num_layers=2)
BIG_BATCH, BIG_SEQ = 2, 4096


def test_chunking_removes_the_full_logits_from_the_compiled_step():
    """Compile only (memory_analysis; nothing runs): the train step's temp bytes with
    chunking are below those without by at least 75% of one [B, T, V] float32 array."""
    strategy, mesh = _mesh("dp", None)
    cfg = get_config("tiny", **BIG_VOCAB)
    common = dict(batch_size=BIG_BATCH, seq_len=BIG_SEQ)
    full, chunked = (
        step_memory(abstract_run(cfg, "dp", mesh, loss_chunk_size=c, **common).compile()[0])
        for c in (0, 1024)
    )
    logits_bytes = BIG_BATCH * BIG_SEQ * cfg.vocab_size * 4
    saved = full.temp_bytes - chunked.temp_bytes
    assert saved >= 0.75 * logits_bytes, (full, chunked, logits_bytes)


def test_bf16_compute_stays_near_the_float32_reference():
    """The hand-written backward pass in the compute dtype the GPU runs (bfloat16 operands,
    float32 logits and head-gradient sum) against the float32 full-logits path. bf16 rounds
    x and the weight by up to 2^-9 relative; measured here, the gradients move by at most
    0.4% of their largest entry (2e-2 leaves a 5x margin); a wrong softmax, target or
    scaling moves them by O(1)."""
    B, T, M, V = 4, 32, 64, 512
    rng = np.random.default_rng(5)
    batch = packed_batch(batch=B, seq=T, vocab=V, seed=4)
    x = jnp.asarray(rng.standard_normal((B, T, M)).astype(np.float32))
    w = jnp.asarray(0.1 * rng.standard_normal((M, V)).astype(np.float32))
    targets, mask = target_mask(jnp.asarray(batch["tokens"]), jnp.asarray(batch["segment_ids"]))
    ref_head = Head(tied=False, dtype=jnp.float32, out_spec=None)
    bf16_head = Head(tied=False, dtype=jnp.bfloat16, out_spec=None)

    def full(x, w):
        nll, m = token_nll(ref_head.logits(x, w), batch["tokens"], batch["segment_ids"])
        return jnp.sum(nll) / jnp.sum(m)

    def chunked(x, w):
        return jnp.sum(chunked_token_nll(x, w, targets, mask, bf16_head, 32)) / jnp.sum(mask)

    grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1)))  # noqa: E731
    (ref_loss, ref_grads), (loss, grads) = grad(full)(x, w), grad(chunked)(x, w)
    assert grads[1].dtype == jnp.float32
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-2)
    for got, ref in zip(grads, ref_grads, strict=True):
        got, ref = np.asarray(got, np.float32), np.asarray(ref)
        assert np.abs(got - ref).max() <= 2e-2 * np.abs(ref).max()


def test_fsdp_head_gradient_in_bf16_stays_near_the_float32_reference():
    """Under FSDP (head `M/data`, rows on `data`) each chunk's head gradient leaves its GEMM
    in the compute dtype and is reduce-scattered in it (zoo/lm_head_loss.py says why: a
    float32 GEMM output there made XLA all-reduce a whole float32 [M, V]); the sum over
    chunks stays float32. Against the float32 one-device gradient, measured here: 0.46% of
    the largest entry in bf16 under FSDP, 0.21% with the float32 GEMM output (cbed04b's,
    still the one-device path); the bound of the test above holds both with a 4x margin."""
    B, T, M, V = 8, 256, 256, 4096
    rng = np.random.default_rng(0)
    x = rng.standard_normal((B, T, M)).astype(np.float32)
    w = (0.05 * rng.standard_normal((M, V))).astype(np.float32)
    targets = jnp.asarray(rng.integers(0, V, (B, T)).astype(np.int32))
    mask = jnp.ones((B, T), bool)

    def head_grad(mesh, w_spec, dtype):
        with jax.set_mesh(mesh):
            put = lambda a, spec: jax.device_put(a, jax.NamedSharding(mesh, spec))  # noqa: E731
            xs, ws = put(x, P("data", None, None)), put(w, w_spec)
            ts, ms = put(targets, P("data", None)), put(mask, P("data", None))
            head = Head(tied=False, dtype=dtype, out_spec=P("data", None, None))
            loss = lambda w: chunked_token_nll(xs, w, ts, ms, head, 64).sum()  # noqa: E731
            return np.asarray(jax.jit(jax.grad(loss))(ws))

    fsdp = get_strategy("fsdp").make_mesh(shape=(8,))
    ref = head_grad(one_device_mesh(), P(None, None), jnp.float32)
    got = head_grad(fsdp, P("data", None), jnp.bfloat16)
    assert got.dtype == np.float32
    assert np.abs(got - ref).max() <= 2e-2 * np.abs(ref).max()
