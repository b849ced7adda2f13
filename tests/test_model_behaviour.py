"""What the model must do whatever the strategy: causality, packed
documents, scanned = unscanned, remat = no remat, KV cache = full recomputation, and one
clear ValueError for each kind of bad input. Float32 on one device unless stated."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from model_utils import build_with_params, host_params, one_device_mesh, packed_batch, put_batch

from shardings import STRATEGIES, check_batch, get_strategy, make_mesh, parse_mesh_shape
from zoo import create_model, get_config
from zoo.build import fit_vocab
from zoo.loss import lm_loss, token_nll

CFG = get_config("tiny")
DP = get_strategy("dp")


def _model(cfg=CFG, seed=0, mesh=None, strategy=DP):
    with jax.set_mesh(mesh or one_device_mesh()):
        return create_model(cfg, strategy, rngs=nnx.Rngs(seed))


def _loaded(cfg, params):
    """A one-device model of `cfg` holding `params`, with no init compile (the checks compare
    one set of weights under two configs)."""
    build = lambda: create_model(cfg, DP, rngs=nnx.Rngs(0))  # noqa: E731
    return build_with_params(build, params, one_device_mesh())


def _logits(model, tokens, segment_ids, positions, mesh=None):
    with jax.set_mesh(mesh or one_device_mesh()):
        fn = nnx.jit(lambda m, t, s, p: m(t, segment_ids=s, positions=p))
        return np.asarray(
            fn(model, jnp.asarray(tokens), jnp.asarray(segment_ids), jnp.asarray(positions))
        )


@pytest.fixture(scope="module")
def model():
    return _model()


def test_causal(model):
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, CFG.vocab_size, (2, 24), dtype=np.int32)
    seg = np.ones_like(tokens)
    pos = np.broadcast_to(np.arange(24, dtype=np.int32), tokens.shape)
    changed = tokens.copy()
    changed[:, 16:] = rng.integers(0, CFG.vocab_size, (2, 8))
    a = _logits(model, tokens, seg, pos)
    b = _logits(model, changed, seg, pos)
    # Masked keys contribute exp(-huge) = 0 exactly, so the prefix is unchanged to rounding.
    np.testing.assert_allclose(a[:, :16], b[:, :16], atol=1e-6, rtol=0)
    assert np.abs(a[:, 16:] - b[:, 16:]).max() > 1e-3  # and the suffix did change


def test_packed_row_equals_documents_alone(model):
    rng = np.random.default_rng(2)
    lengths = [7, 10, 9]
    T = 32
    docs = [rng.integers(1, CFG.vocab_size, n, dtype=np.int32) for n in lengths]
    packed = {k: np.zeros((1, T), np.int32) for k in ("tokens", "segment_ids", "positions")}
    start = 0
    for i, doc in enumerate(docs):
        sl = slice(start, start + len(doc))
        packed["tokens"][0, sl] = doc
        packed["segment_ids"][0, sl] = i + 1
        packed["positions"][0, sl] = np.arange(len(doc))
        start += len(doc)
    alone = {k: np.zeros((len(docs), T), np.int32) for k in packed}
    for i, doc in enumerate(docs):
        alone["tokens"][i, : len(doc)] = doc
        alone["segment_ids"][i, : len(doc)] = 1
        alone["positions"][i, : len(doc)] = np.arange(len(doc))

    def per_doc_nll(batch):
        logits = _logits(model, batch["tokens"], batch["segment_ids"], batch["positions"])
        nll, mask = token_nll(jnp.asarray(logits), batch["tokens"], batch["segment_ids"])
        nll, mask = np.asarray(nll), np.asarray(mask)
        seg = batch["segment_ids"]
        counts = [(mask & (seg == s)).sum() for s in np.unique(seg[seg > 0])]
        return [nll[seg == s].sum() for s in np.unique(seg[seg > 0])], counts, nll.shape[0]

    packed_nll, packed_counts, _ = per_doc_nll(packed)
    alone_nll = []
    for i in range(len(docs)):
        row = {k: v[i : i + 1] for k, v in alone.items()}
        nll, counts, _ = per_doc_nll(row)
        assert counts == [lengths[i] - 1]  # a document's last token has no target
        alone_nll += nll
    assert packed_counts == [n - 1 for n in lengths]
    np.testing.assert_allclose(packed_nll, alone_nll, rtol=1e-5, atol=1e-5)


def test_loss_mask_ignores_padding_and_document_ends():
    tokens = jnp.array([[5, 6, 7, 8, 9, 0]])
    seg = jnp.array([[1, 1, 2, 2, 2, 0]])
    logits = jnp.zeros((1, 6, 16))
    loss, count = lm_loss(logits, tokens, seg)
    assert int(count) == 3  # 5->6, 7->8, 8->9
    np.testing.assert_allclose(float(loss), np.log(16), rtol=1e-6)


def _to_unscanned(params, num_layers):
    out = {}
    for path, value in params.items():
        if path.startswith("blocks/"):
            for i in range(num_layers):
                out[path.replace("blocks/", f"blocks/{i}/", 1)] = value[i]
        else:
            out[path] = value
    return out


def test_scanned_equals_unscanned(model):
    batch = packed_batch(batch=2, seq=24, vocab=CFG.vocab_size, seed=3)
    unscanned = _loaded(
        CFG.replace(scan_layers=False), _to_unscanned(host_params(model), CFG.num_layers)
    )
    a = _logits(model, **batch)
    b = _logits(unscanned, **batch)
    np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)


def _grads(m, batch):
    def loss_fn(m):
        logits = m(batch["tokens"], segment_ids=batch["segment_ids"], positions=batch["positions"])
        return lm_loss(logits, batch["tokens"], batch["segment_ids"])[0]

    with jax.set_mesh(one_device_mesh()):
        g = nnx.jit(nnx.grad(loss_fn))(m)
    return {"/".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(g)}


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_remat_gives_equal_gradients(model, remat):
    batch = packed_batch(batch=2, seq=24, vocab=CFG.vocab_size, seed=4)
    rematted = _loaded(CFG.replace(remat=remat), host_params(model))
    ref, got = _grads(model, batch), _grads(rematted, batch)
    for path in ref:
        # Recomputation replays the same ops; only XLA's fusion choices may differ.
        np.testing.assert_allclose(got[path], ref[path], atol=1e-7, rtol=1e-6, err_msg=path)


def _scan_whiles(cfg, mesh, strategy=DP) -> int:
    """While loops in the lowered (pre-XLA) eval step: the layer scan is one unless it is
    unrolled."""
    from nnx_zoo.launch.build import abstract_run

    run = abstract_run(cfg, strategy.name, mesh, batch_size=8, seq_len=16)
    with jax.set_mesh(mesh):
        text = run.trainer.lower(run.abstract_batch(), train=False).as_text()
    return text.count("stablehlo.while")


@pytest.mark.parametrize("remat", ["none", "full"])
def test_unrolled_layer_scan_equals_rolled(model, remat):
    # scan_unroll=0 (auto, the default) unrolls the layer scan on CPU without remat; 1 keeps
    # XLA's loop.
    batch = packed_batch(batch=2, seq=24, vocab=CFG.vocab_size, seed=7)
    params = host_params(model)
    unrolled = (
        model if remat == "none" else _loaded(CFG.replace(remat=remat, scan_unroll=2), params)
    )
    rolled = _loaded(CFG.replace(scan_unroll=1, remat=remat), params)
    # Same ops in the same order; XLA fuses a loop body and straight-line code differently.
    np.testing.assert_allclose(
        _logits(unrolled, **batch), _logits(rolled, **batch), atol=1e-6, rtol=0
    )
    ref, got = _grads(rolled, batch), _grads(unrolled, batch)
    for path in ref:
        np.testing.assert_allclose(got[path], ref[path], atol=1e-7, rtol=1e-6, err_msg=path)
    mesh = one_device_mesh()
    assert _scan_whiles(CFG, mesh) + 1 == _scan_whiles(CFG.replace(scan_unroll=1), mesh)
    # Two layers per iteration of a 2-layer model is the whole stack: no loop either.
    assert _scan_whiles(CFG.replace(scan_unroll=2), mesh) == _scan_whiles(CFG, mesh)
    # With remat, auto keeps the loop: unrolled, XLA CPU keeps every layer's activations
    # live and the remat would save no memory (tests/test_remat_policies.py).
    full = CFG.replace(remat="full")
    assert _scan_whiles(full, mesh) == _scan_whiles(full.replace(scan_unroll=1), mesh)


@pytest.mark.tpu_compile
def test_layer_scan_stays_rolled_for_tpu_targets():
    from nnx_zoo.planning import target_devices

    mesh = make_mesh(DP, devices=target_devices("v5p:2x2x2"))
    # auto keeps one compiled block on TPU (compile time), like an explicit 1.
    assert _scan_whiles(CFG, mesh) == _scan_whiles(CFG.replace(scan_unroll=1), mesh)
    assert (
        _scan_whiles(CFG, mesh) == _scan_whiles(CFG.replace(scan_unroll=CFG.num_layers), mesh) + 1
    )


def _decode_all(model, tokens, prompt_len, mesh, strategy):
    """Logits for every position, from a prefill of `prompt_len` tokens then one token at a
    time through the KV cache."""
    B, T = tokens.shape
    seg = np.ones((B, T), np.int32)
    pos = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
    with jax.set_mesh(mesh):
        spec = strategy.batch_spec()
        step = nnx.jit(lambda m, t, s, p, c: m.forward(t, segment_ids=s, positions=p, cache=c)[:2])
        cache = model.init_cache(B, T)
        chunks = [(0, prompt_len)] + [(t, t + 1) for t in range(prompt_len, T)]
        out = []
        for a, b in chunks:
            args = [jax.device_put(jnp.asarray(x[:, a:b]), spec) for x in (tokens, seg, pos)]
            logits, cache = step(model, *args, cache)
            out.append(np.asarray(logits))
    return np.concatenate(out, axis=1)


@pytest.mark.parametrize(
    "strategy_name,shape,window", [("dp", (1,), None), ("dp", (1,), 5), ("fsdp_tp", (4, 2), None)]
)
def test_kv_cache_equals_full_forward(strategy_name, shape, window):
    strategy = get_strategy(strategy_name)
    devices = jax.devices()[: int(np.prod(shape))]
    mesh = make_mesh(strategy, shape=shape, devices=devices)
    cfg = CFG.replace(sliding_window=window)
    model = _model(cfg, mesh=mesh, strategy=strategy)
    tokens = np.random.default_rng(5).integers(0, CFG.vocab_size, (4, 12), dtype=np.int32)
    seg = np.ones_like(tokens)
    pos = np.broadcast_to(np.arange(12, dtype=np.int32), tokens.shape)
    with jax.set_mesh(mesh):
        batch = put_batch({"t": tokens, "s": seg, "p": pos}, strategy.batch_spec())
        full = np.asarray(
            nnx.jit(lambda m, t, s, p: m(t, segment_ids=s, positions=p))(model, *batch.values())
        )
    cached = _decode_all(model, tokens, 5, mesh, strategy)
    np.testing.assert_allclose(cached, full, atol=2e-5, rtol=0)


def test_bfloat16_compute_tracks_float32(model):
    batch = packed_batch(batch=2, seq=24, vocab=CFG.vocab_size, seed=6)
    bf16 = _loaded(CFG.replace(dtype="bfloat16"), host_params(model))
    a, b = _logits(model, **batch), _logits(bf16, **batch)
    assert b.dtype == np.float32  # logits are float32 for the loss whatever the compute dtype
    # bfloat16 keeps 8 bits of mantissa: ~0.4% relative error per op, a few ops deep.
    assert np.abs(a - b).max() < 0.05 * np.abs(a).max()


# -- bad input ------------------------------------------------------------------------------


def test_unknown_strategy_lists_valid_names():
    with pytest.raises(ValueError, match=r"unknown sharding strategy 'zero3'") as info:
        get_strategy("zero3")
    assert str(info.value).endswith("valid strategies: " + ", ".join(sorted(STRATEGIES)))
    assert "dp, fsdp" in str(info.value)


@pytest.mark.parametrize(
    "name,shape,message",
    [
        ("fsdp_tp", (4, 4), r"needs 16 devices but 8 are available"),
        ("fsdp_tp", (8,), r"has 1 axes; strategy 'fsdp_tp' has 2 \(data, model\)"),
        ("dp", (4, 2), r"has 2 axes; strategy 'dp' has 1 \(data\)"),
        ("tp", "data:2,expert:4", r"mesh axis 'expert' is not used by this strategy"),
        ("tp", "data:2", r"does not name axes \['model'\]"),
    ],
)
def test_mesh_that_does_not_fit_is_rejected(name, shape, message):
    with pytest.raises(ValueError, match=message):
        get_strategy(name).make_mesh(shape=shape)


def test_heads_not_divisible_by_model_axis_names_the_array():
    strategy = get_strategy("tp")
    mesh = strategy.make_mesh(shape=(1, 8))  # tiny has 4 kv heads
    with (
        pytest.raises(ValueError, match=r"blocks/attention/k/weight .* dim 2 \(size 4\).*model=8"),
        jax.set_mesh(mesh),
    ):
        create_model(CFG, strategy, rngs=nnx.Rngs(0))


def test_batch_not_divisible_by_data_axis():
    strategy = get_strategy("dp")
    mesh = strategy.make_mesh()
    with pytest.raises(
        ValueError, match=r"batch size 6 is split over mesh axis data=8.*multiple of 8"
    ):
        check_batch(6, strategy.batch_spec(), mesh, "dp")


def test_mesh_shape_parsing():
    assert parse_mesh_shape("model:2,data:4", ("data", "model")) == (4, 2)
    assert parse_mesh_shape("4,2", ("data", "model")) == (4, 2)
    with pytest.raises(ValueError, match="not an integer"):
        parse_mesh_shape("data:x", ("data",))


def test_default_mesh_rule():
    kv4, kv8 = CFG.replace(num_kv_heads=4), CFG.replace(num_kv_heads=8)
    assert get_strategy("dp").default_mesh_shape(8) == (8,)
    assert get_strategy("fsdp_tp").default_mesh_shape(8, kv4) == (4, 2)
    assert get_strategy("fsdp_tp").default_mesh_shape(64, kv8) == (8, 8)
    assert get_strategy("tp").default_mesh_shape(8, kv4) == (2, 4)
    assert get_strategy("tp").default_mesh_shape(16, kv8) == (2, 8)


def test_tied_vocab_not_divisible_is_padded_for_its_logits():
    # A tied model has no LM head weight; the logits' vocab split alone asks for the padding
    # (to 128 x the 2 shards). Its numbers are tests/test_vocab_padding.py's.
    strategy = get_strategy("tp")
    cfg = CFG.replace(vocab_size=129, tie_embeddings=True)
    with jax.set_mesh(strategy.make_mesh(shape=(4, 2))):
        model = create_model(cfg, strategy, rngs=nnx.Rngs(0))
    assert (model.cfg.vocab_size, model.cfg.padded_vocab_size) == (129, 256)
    assert model.embed.table[...].shape[0] == 256
    # Where the vocab is not split, nothing is padded.
    fsdp = get_strategy("fsdp")
    assert fit_vocab(cfg, fsdp, fsdp.make_mesh(shape=(8,))) is cfg
