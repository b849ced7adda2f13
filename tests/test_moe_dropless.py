"""The dropless expert compute equals a naive per-token loop over each token's chosen experts,
on one device and with experts split over an expert axis (the all-to-all path), including
routing where every token picks the same experts (one expert shard receives every token).

Tolerance: float32; the loop and the sorted ragged_dot sum the same products in another order
(and the k experts' contributions in another order): 1e-5 absolute on outputs of size ~1.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from shardings import get_strategy
from zoo import get_config
from zoo.layers.moe import Moe

ATOL = 1e-5
B, T = 8, 16


def _naive(x_BTM, router_ME, gate_EMF, up_EMF, down_EFM, k, norm_topk_prob):
    """numpy, one token at a time: softmax router, top k (ties to the lower expert id, as
    lax.top_k), optional renormalisation, the weighted sum of the k experts' SwiGLU."""
    out = np.zeros_like(x_BTM)
    counts = np.zeros(router_ME.shape[1])
    for b in range(x_BTM.shape[0]):
        for t in range(x_BTM.shape[1]):
            x = x_BTM[b, t].astype(np.float64)
            logits = x @ router_ME
            probs = np.exp(logits - logits.max())
            probs /= probs.sum()
            chosen = np.argsort(-probs, kind="stable")[:k]
            weights = probs[chosen] / (probs[chosen].sum() if norm_topk_prob else 1.0)
            for e, w in zip(chosen, weights, strict=True):
                g, u = x @ gate_EMF[e], x @ up_EMF[e]
                out[b, t] += w * ((g / (1 + np.exp(-g)) * u) @ down_EFM[e])
                counts[e] += 1
    return out, counts


def _run(cfg, strategy_name, shape, zero_router, with_dropped=False):
    """(x, y, counts, params); y is (y, share of assignments dropped) with `with_dropped`."""
    strategy = get_strategy(strategy_name)
    devices = jax.devices()[:1] if shape == (1,) else None
    mesh = strategy.make_mesh(shape=shape, devices=devices)
    x_BTM = np.random.default_rng(0).normal(size=(B, T, cfg.hidden_dim)).astype(np.float32)
    with jax.set_mesh(mesh):
        moe = nnx.jit(lambda r: Moe(cfg, strategy.lm_sharding().block.moe, rngs=r))(nnx.Rngs(0))
        if zero_router:  # every logit equal: top-k ties, so every token picks experts 0..k-1
            moe.router.weight.set_value(np.zeros(moe.router.weight.get_value().shape, np.float32))
        spec = strategy.lm_sharding().block.moe.tokens
        x = jax.device_put(x_BTM, spec)
        y, stats = nnx.jit(lambda m, x: m(x, np.ones((B, T), bool)))(moe, x)
        params = [
            np.asarray(p.get_value(), np.float64)
            for p in (moe.router.weight, moe.gate, moe.up, moe.down)
        ]
    y = (np.asarray(y), float(stats.dropped_share)) if with_dropped else np.asarray(y)
    return x_BTM, y, np.asarray(stats.counts), params


CASES = [
    ("dp", (1,), False, True),
    ("fsdp_ep", (2, 4), False, True),
    ("fsdp_ep", (2, 4), True, False),  # also the not-renormalised router
    ("fsdp_tp", (4, 2), True, True),  # F split: partial sums reduce-scattered
]


@pytest.mark.parametrize("strategy_name,shape,zero_router,norm", CASES)
def test_dropless_equals_per_token_loop(strategy_name, shape, zero_router, norm):
    cfg = get_config("qwen3-moe-tiny", norm_topk_prob=norm)
    x, y, counts, params = _run(cfg, strategy_name, shape, zero_router)
    want, want_counts = _naive(x, *params, cfg.num_experts_per_tok, norm)
    np.testing.assert_allclose(y, want, atol=ATOL, rtol=0)
    np.testing.assert_array_equal(counts, want_counts)  # no token dropped
    if zero_router:
        assert counts[0] == counts[1] == B * T and counts[2:].sum() == 0
