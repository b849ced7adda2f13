"""A naive attention reference, written independently of zoo/layers/attention/.

A mask built by explicit loops over (b, t, s) in numpy from the rule "same segment, kv_pos <=
q_pos if causal, q_pos - kv_pos < window", kv heads repeated to N (instead of grouped), -inf
for masked logits (instead of a finite minimum), and jax.nn.softmax, in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from bench.fixtures import packed_rows  # noqa: F401 -- the tests' packed rows, shared with bench


def reference_mask(q_seg, kv_seg, q_pos, kv_pos, causal, window):
    q_seg, kv_seg, q_pos, kv_pos = map(np.asarray, (q_seg, kv_seg, q_pos, kv_pos))
    B, T = q_seg.shape
    S = kv_seg.shape[1]
    mask = np.zeros((B, T, S), bool)
    for b in range(B):
        for t in range(T):
            for s in range(S):
                ok = q_seg[b, t] == kv_seg[b, s]
                if causal:
                    ok = ok and kv_pos[b, s] <= q_pos[b, t]
                if window is not None and window > 0:
                    ok = ok and q_pos[b, t] - kv_pos[b, s] < window
                mask[b, t, s] = ok
    assert mask.any(axis=-1).all(), "a query with no visible key: the reference would be NaN"
    return mask


def reference_attention(q, k, v, mask_BTS, scale):
    G = q.shape[2] // k.shape[2]
    k_rep = jnp.repeat(k.astype(jnp.float32), G, axis=2)  # kv head of query head n: n // G
    v_rep = jnp.repeat(v.astype(jnp.float32), G, axis=2)
    scores = jnp.einsum("btnd,bsnd->bnts", q.astype(jnp.float32), k_rep) * scale
    scores = jnp.where(jnp.asarray(mask_BTS)[:, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bnts,bsnd->btnd", probs, v_rep)
