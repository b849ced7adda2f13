"""zoo/generate.py: KV-cache generation equals greedy full recomputation, token for token."""

import functools

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from shardings import get_strategy
from zoo import create_model, get_config
from zoo.generate import batch_multiple, generate, model_mesh

CFG = get_config("tiny")  # float32 compute
# Different lengths, so left padding and per-row positions are exercised; 3 prompts also
# need padding rows to fill a data axis of 4 or 8.
PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [100, 200, 300, 400, 500, 60, 7, 9, 11]]
NEW_TOKENS = 8


@functools.partial(jax.jit, static_argnames="graphdef")
def _full_logits(graphdef, state, tokens_BT, segment_ids_BT, positions_BT):
    model = nnx.merge(graphdef, state)
    # One document per row from index 0, then padding: length-only attention paths apply.
    return model(tokens_BT, segment_ids=segment_ids_BT, positions=positions_BT, packed=False)


def greedy_reference(model, prompt: list[int], n: int) -> list[int]:
    """`n` greedy tokens by recomputing the whole sequence without a cache at every step.

    Each step runs the full forward pass over the prompt and every token chosen so far. The
    row has a fixed length (prompt + n, right-padded with segment id 0, which no real token
    attends), so all steps share one compiled function.
    """
    mesh = model_mesh(model)
    rows = batch_multiple(model, mesh)
    sharding = NamedSharding(mesh, model.sharding.tokens)
    graphdef, state = nnx.split(model)
    T = len(prompt) + n
    ids = list(prompt)
    with jax.set_mesh(mesh):
        for _ in range(n):
            tokens, segment_ids, positions = (np.zeros((rows, T), np.int32) for _ in range(3))
            tokens[:, : len(ids)] = ids
            segment_ids[:, : len(ids)] = 1
            positions[:, : len(ids)] = np.arange(len(ids))
            arrays = [jax.device_put(a, sharding) for a in (tokens, segment_ids, positions)]
            logits_BTV = np.asarray(_full_logits(graphdef, state, *arrays))
            ids.append(int(logits_BTV[0, len(ids) - 1].argmax()))
    return ids[len(prompt) :]


def build(strategy_name, shape):
    strategy = get_strategy(strategy_name)
    mesh = strategy.make_mesh(shape=shape)
    with jax.set_mesh(mesh):
        return create_model(CFG, strategy, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def models():
    return {"dp": build("dp", (8,)), "fsdp_tp": build("fsdp_tp", (4, 2))}


@pytest.mark.parametrize("strategy_name", ["dp", "fsdp_tp"])
def test_cache_equals_full_recomputation(models, strategy_name):
    model = models[strategy_name]
    got = generate(model, PROMPTS, max_new_tokens=NEW_TOKENS)
    want = [greedy_reference(model, p, NEW_TOKENS) for p in PROMPTS]
    assert got == want
    assert all(len(ids) == NEW_TOKENS for ids in got)
    # A prompt alone gives what it gave inside the padded batch.
    assert generate(model, [PROMPTS[1]], max_new_tokens=NEW_TOKENS) == [got[1]]


def test_same_tokens_under_every_strategy(models):
    greedy = {name: generate(m, PROMPTS, max_new_tokens=NEW_TOKENS) for name, m in models.items()}
    assert greedy["dp"] == greedy["fsdp_tp"]
    sampled = {
        name: generate(m, PROMPTS, max_new_tokens=NEW_TOKENS, temperature=1.0, top_k=20, seed=3)
        for name, m in models.items()
    }
    assert sampled["dp"] == sampled["fsdp_tp"]  # random draws do not depend on the mesh
    assert sampled["dp"] != greedy["dp"]


def test_sampling_settings(models):
    model = models["fsdp_tp"]
    greedy = generate(model, PROMPTS, max_new_tokens=NEW_TOKENS)
    assert generate(model, PROMPTS, max_new_tokens=NEW_TOKENS, temperature=0.7, top_k=1) == greedy
    a = generate(model, PROMPTS, max_new_tokens=NEW_TOKENS, temperature=2.0, seed=1)
    b = generate(model, PROMPTS, max_new_tokens=NEW_TOKENS, temperature=2.0, seed=1)
    c = generate(model, PROMPTS, max_new_tokens=NEW_TOKENS, temperature=2.0, seed=2)
    assert a == b != c


def test_stops_at_eos(models):
    model = models["dp"]
    greedy = generate(model, PROMPTS, max_new_tokens=NEW_TOKENS)
    eos = greedy[0][3]
    out = generate(model, PROMPTS, max_new_tokens=NEW_TOKENS, eos_id=eos)
    for row, full in zip(out, greedy, strict=True):
        assert row == (full[: full.index(eos)] if eos in full else full)


def test_bad_arguments_fail_clearly(models):
    model = models["dp"]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        generate(model, [[CFG.vocab_size]], max_new_tokens=2)
    with pytest.raises(ValueError, match="max_seq_len"):
        generate(model, [[1]], max_new_tokens=CFG.max_seq_len)


def nucleus_reference(logits_BV: np.ndarray, top_p: float) -> np.ndarray:
    """One token at a time, most likely first, until their probability reaches top_p
    (float64): the definition of nucleus sampling's candidate set."""
    out = np.full_like(logits_BV, -np.inf)
    for row, logits in enumerate(logits_BV.astype(np.float64)):
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        total = 0.0
        for token in np.argsort(-logits, kind="stable"):
            out[row, token] = logits_BV[row, token]
            total += probs[token]
            if total >= top_p:
                break
    return out


@pytest.mark.parametrize("top_p", [1e-6, 0.3, 0.9, 0.999])
def test_nucleus_keeps_what_the_naive_definition_keeps(top_p):
    from zoo.sampling import nucleus

    rng = np.random.default_rng(0)
    logits = rng.normal(0.0, 3.0, (6, 50)).astype(np.float32)
    logits[1, :40] = -np.inf  # what top-k leaves: only 10 candidates
    logits[2, 7] = 30.0  # one token holds nearly all the mass: it alone is the nucleus
    got = np.asarray(nucleus(jax.numpy.asarray(logits), jax.numpy.full((6,), top_p)))
    want = nucleus_reference(logits, top_p)
    # The same candidates and untouched logits. The float32 cumulative sum can differ from
    # float64 only where a prefix's mass lies within ~1e-6 of top_p; these seeded rows have
    # no such prefix (the masks are compared exactly).
    np.testing.assert_array_equal(got, want)
    assert np.isfinite(got[2]).sum() == 1 and np.isfinite(got[2, 7])


def test_top_p_sampling_through_the_cache(models):
    model = models["fsdp_tp"]
    greedy = generate(model, PROMPTS, max_new_tokens=NEW_TOKENS)
    # A nucleus too small for any second token leaves the argmax: sampling becomes greedy.
    tight = generate(model, PROMPTS, max_new_tokens=NEW_TOKENS, temperature=1.0, top_p=1e-6)
    assert tight == greedy
    with pytest.raises(ValueError, match=r"top_p=0 must be in \(0, 1\]"):
        generate(model, PROMPTS, max_new_tokens=2, temperature=1.0, top_p=0)
