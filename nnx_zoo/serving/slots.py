"""The device side of continuous batching: `max_batch` decode slots over one KV cache.

    slots = Slots(model, max_batch=8, max_seq_len=256)
    first = slots.prefill([prompt_ids], slot=[3], sampling=...)   # a request joins slot 3
    tokens = slots.decode(last_B, active_B, sampling_B)          # one token for every slot

Layout. The cache is the model's own `KVCache` ([L, B, S, K, D] keys and values, [B, S]
segment ids and positions) with one write column *per row* (`index` [B]): slot b holds one
request from column 0 (its prompt, then each token it generates at the next column), so a
token's column is its position. Segment id 1 marks the request's tokens, 0 everything else,
which no query attends: a slot's old request, left behind when a new one is inserted, is
masked by resetting the row's segment ids, not by clearing its keys.

Prefill. A new request's prompt runs alone (well, in `rows` rows: the batch must divide over
the mesh's `data` axis; spare rows repeat the last request, and their writes repeat its
writes), right-padded to a length bucket (powers of two up to `max_seq_len`), into a fresh
cache of that length; its keys and values are then written into the slot's row of the big
cache, and the first token is drawn from the logits of the prompt's last token. One compiled
program per bucket, each used by every request whose prompt fits it.

Decode. One token for each of the `max_batch` slots (T = 1), every step the same shapes: one
compiled program. A free slot computes too (its row is masked: segment id 0, and its write
column does not move); that is the price of a fixed shape.

Both programs donate the cache, so XLA updates it in place; so a call that fails leaves no
cache behind (its buffers were given to the call, or are the failed call's output). Such a
failure raises `CacheLostError` once a fresh empty cache took the old one's place: every
request that was in the cache is gone, and the next prefill starts over on the new one.

The stacked layer weights are split into one array per layer once, at construction
(`zoo.generate.layer_list`): prefill and decode then read each layer's weights directly (for
one-token steps the scan's per-layer slice copy triples the traffic), and the weights are held
once.

Log probabilities. Both programs return, with each token drawn, its log-probability and the
`MAX_LOGPROBS` most likely tokens' (`Drawn`): log_softmax of the float32 logits the sampler
draws from, before temperature, top-k or top-p (the model's own distribution, which is what
OpenAI reports). A request slices the first k it asked for on the host, so no k compiles a
program. A prompt to be scored (the API's `echo`) runs a prefill's second variant per bucket,
`score`, which also runs the LM head over every prompt column and returns, at each one, the
log-probability of the prompt's next token and the top `MAX_LOGPROBS` (`PromptScores`): the
plain prefill computes the logits of the last column only, so a prompt no one scores pays
nothing for it. The `score` programs compile on first use (warm-up compiles the plain ones).

`traces` counts how often each program was traced: one per bucket used (and per variant) and
one decode, never one per request (the engine's tests check it).
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_zoo.errors import UsageError
from zoo.generate import batch_multiple, layer_list, model_mesh
from zoo.sampling import SamplingRows, pick, sample

MIN_BUCKET = 16
# The most alternatives per token a request may ask for (OpenAI's chat limit: top_logprobs
# <= 20); the programs always compute this many, a request takes its first k.
MAX_LOGPROBS = 20


class Drawn(NamedTuple):
    """Per row: the token drawn and the log-probabilities around it (numpy, host side)."""

    token: np.ndarray  # int32 [N]
    logprob: np.ndarray  # float32 [N]: log p(token)
    top_ids: np.ndarray  # int32 [N, K]: the K most likely tokens, most likely first
    top_logprobs: np.ndarray  # float32 [N, K]


class PromptScores(NamedTuple):
    """Per row, per prompt column t (up to the bucket): log p(prompt[t + 1] | prompt[: t + 1])
    and the K most likely tokens at t. Columns from the prompt's last on are meaningless."""

    logprob: np.ndarray  # float32 [N, P]
    top_ids: np.ndarray  # int32 [N, P, K]
    top_logprobs: np.ndarray  # float32 [N, P, K]


class CacheLostError(RuntimeError):
    """A prefill or decode call failed: the requests in the KV cache are lost (the cache is
    empty again); the error it raised is the `__cause__`."""


def buckets(max_seq_len: int, smallest: int = MIN_BUCKET) -> tuple[int, ...]:
    """Prefill lengths: powers of two from `smallest`, then `max_seq_len` itself."""
    out, length = [], smallest
    while length < max_seq_len:
        out.append(length)
        length *= 2
    return (*out, max_seq_len)


class Slots:
    def __init__(self, model, *, max_batch: int, max_seq_len: int, dtype=None, mesh=None):
        """`model`: a model (its weights are copied into per-layer arrays), or an abstract
        one (`zoo.build.abstract_model`, with its `mesh`: e.g. a target's devices) whose
        programs are only compiled."""
        cfg = model.cfg
        if max_seq_len > cfg.max_seq_len:
            raise UsageError(
                f"--max_seq_len={max_seq_len} exceeds the model's max_seq_len={cfg.max_seq_len}"
            )
        self.mesh = mesh or model_mesh(model)
        self.rows = batch_multiple(model, self.mesh)
        # The one check of --max_batch (--max_queue: the Scheduler).
        if max_batch < 1:
            raise UsageError(f"--max_batch={max_batch} must be >= 1")
        if max_batch % self.rows:
            raise UsageError(
                f"--max_batch={max_batch} must be a multiple of {self.rows} (the size of the "
                f"mesh axis the batch is split over, in {dict(self.mesh.shape)})"
            )
        self.max_batch, self.max_seq_len = max_batch, max_seq_len
        self.vocab_size = cfg.vocab_size
        self.buckets = buckets(max_seq_len)
        self.traces: collections.Counter = collections.Counter()
        tokens_spec = model.sharding.tokens
        self._tokens = NamedSharding(self.mesh, tokens_spec)
        self._rows = NamedSharding(self.mesh, P(tokens_spec[0]))
        with jax.set_mesh(self.mesh):
            if _abstract(model):  # compile only: shapes and layouts, nothing allocated
                self._graphdef, self._state = _abstract_layer_list(model)
                self.cache = jax.eval_shape(
                    lambda: _empty_cache(model, max_batch, max_seq_len, dtype)
                )
            else:
                self._graphdef, self._state = layer_list(model)
                self.cache = _empty_cache(model, max_batch, max_seq_len, dtype)
        self._cache_shapes = jax.tree.map(_shape, self.cache)  # an empty cache is all zeros
        self._prefill: dict[tuple[int, bool], object] = {}
        self._decode = None
        self._steady: tuple = (None, None, None)  # (key, active_B, sampling_B) of `decode`

    # -- compiling ---------------------------------------------------------------------

    def bucket(self, length: int) -> int:
        """The prefill length a prompt of `length` tokens runs at."""
        if not 1 <= length <= self.max_seq_len:
            raise ValueError(f"a prompt of {length} tokens does not fit {self.max_seq_len}")
        return next(b for b in self.buckets if b >= length)

    def compile_prefill(self, bucket: int, score: bool = False):
        """The prefill program of `bucket`; `score`: its variant that scores the prompt."""
        if (bucket, score) not in self._prefill:
            program = functools.partial(_prefill, self._graphdef, self.traces, score)
            fn = jax.jit(program, donate_argnums=1)
            R, rows = self.rows, self._shapes_of_rows
            tokens = jax.ShapeDtypeStruct((R, bucket), jnp.int32, sharding=self._tokens)
            args = (*self._shapes(), tokens, rows(R, jnp.int32), rows(R, jnp.int32))
            with jax.set_mesh(self.mesh):
                compiled = fn.lower(*args, self._sampling_shapes(R)).compile()
            self._prefill[bucket, score] = compiled
        return self._prefill[bucket, score]

    def compile_decode(self):
        if self._decode is None:
            fn = jax.jit(functools.partial(_decode, self._graphdef, self.traces), donate_argnums=1)
            B, rows = self.max_batch, self._shapes_of_rows
            args = (*self._shapes(), rows(B, jnp.int32), rows(B, jnp.bool_))
            with jax.set_mesh(self.mesh):
                self._decode = fn.lower(*args, self._sampling_shapes(B)).compile()
        return self._decode

    def _shapes(self):
        """(weights, cache) as shapes with their layouts: what the programs are compiled for
        (the same whether this instance holds arrays or, to compile for a target, shapes)."""
        return jax.tree.map(_shape, self._state), self._cache_shapes

    def _shapes_of_rows(self, n: int, dtype):
        return jax.ShapeDtypeStruct((n,), dtype, sharding=self._rows)

    def _sampling_shapes(self, n: int) -> SamplingRows:
        dtypes = (jnp.float32, jnp.int32, jnp.float32, jnp.uint32)
        return SamplingRows(*(self._shapes_of_rows(n, d) for d in dtypes))

    # -- running -----------------------------------------------------------------------

    def prefill(
        self,
        prompts: Sequence[Sequence[int]],
        slots: Sequence[int],
        sampling,
        *,
        score: bool = False,
    ) -> tuple[Drawn, PromptScores | None]:
        """Write each prompt into its slot (the slot's old request is gone) and return each
        one's first token (`Drawn`), and with `score` each prompt's `PromptScores`.
        `sampling`: (temperature, top_k, top_p, seed) lists, one entry per prompt. At most
        `self.rows` prompts, all of one bucket's length."""
        n = len(prompts)
        if not 1 <= n <= self.rows:
            raise ValueError(f"prefill takes 1 to {self.rows} prompts, not {n}")
        lengths = [len(p) for p in prompts]
        bucket = self.bucket(max(lengths))
        # Spare rows repeat the last prompt into the last slot: the same writes twice.
        pad = self.rows - n
        prompts, slots = [*prompts, *[prompts[-1]] * pad], [*slots, *[slots[-1]] * pad]
        lengths = [*lengths, *[lengths[-1]] * pad]
        sampling = [[*column, *[column[-1]] * pad] for column in sampling]
        tokens = np.zeros((self.rows, bucket), np.int32)
        for row, prompt in enumerate(prompts):
            tokens[row, : len(prompt)] = prompt
        program = self.compile_prefill(bucket, score)
        args = (
            self._put(tokens, self._tokens),
            *self._row_args(np.asarray(lengths, np.int32), np.asarray(slots, np.int32)),
            self._sampling(*sampling),
        )
        drawn, scores = self._run(program, *args)
        drawn = Drawn(*(a[:n] for a in drawn))
        return drawn, None if scores is None else PromptScores(*(a[:n] for a in scores))

    def decode(self, tokens: Sequence[int], active: Sequence[bool], sampling) -> Drawn:
        """One token for every slot (`Drawn` of max_batch rows; a free slot's is meaningless).
        `tokens`: each slot's last token; `sampling`: per-slot lists as in `prefill`."""
        program = self.compile_decode()
        # Which slots run, and how they sample, change only when a request joins or leaves:
        # their device copies are kept until then; the tokens change every step.
        key = (tuple(active), *map(tuple, sampling))
        if key != self._steady[0]:
            active_B = self._put(np.asarray(active, bool), self._rows)
            self._steady = (key, active_B, self._sampling(*sampling))
        _, active_B, sampling_B = self._steady
        tokens_B = self._put(np.asarray(tokens, np.int32), self._rows)
        return Drawn(*self._run(program, tokens_B, active_B, sampling_B))

    def _run(self, program, *args):
        """program(weights, cache, *args): the cache updated, its outputs on the host. A
        failure (at the call, or when its result is read: dispatch is asynchronous) loses
        the cache: `CacheLostError`, a fresh one in its place."""
        try:
            self.cache, out = program(self._state, self.cache, *args)
            return jax.tree.map(np.asarray, out)
        except Exception as e:
            self.reset()
            raise CacheLostError(f"{type(e).__name__}: {' '.join(str(e).split())[:500]}") from e

    def reset(self) -> None:
        """An empty cache (every slot free) in place of the current one, whose buffers are
        freed first: after a failure the device may be short of memory."""
        for leaf in jax.tree.leaves(self.cache):
            if not leaf.is_deleted():
                leaf.delete()
        self.cache = jax.tree.map(
            lambda s: jnp.zeros(s.shape, s.dtype, device=s.sharding), self._cache_shapes
        )
        self._steady = (None, None, None)

    # -- host arrays to device -----------------------------------------------------------

    def _put(self, array, sharding):
        return jax.device_put(array, sharding)

    def _row_args(self, *arrays):
        return [self._put(a, self._rows) for a in arrays]

    def _sampling(self, temperature, top_k, top_p, seed) -> SamplingRows:
        return SamplingRows(
            *self._row_args(
                np.asarray(temperature, np.float32),
                np.asarray(top_k, np.int32),
                np.asarray(top_p, np.float32),
                np.asarray(seed, np.uint32),
            )
        )


def _shape(x) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)


def _abstract(model) -> bool:
    return not isinstance(jax.tree.leaves(nnx.state(model, nnx.Param))[0], jax.Array)


def _abstract_layer_list(model):
    """`layer_list` of an abstract model (`zoo.build.abstract_model`): its graph, and its
    per-layer weights as shapes with their layouts."""
    graphdef, state = nnx.split(model)
    found = {}

    def unstack(state):
        found["graphdef"], per_layer = layer_list(nnx.merge(graphdef, state))
        return per_layer

    per_layer = jax.eval_shape(unstack, state)
    return found["graphdef"], per_layer


def _empty_cache(model, max_batch: int, max_seq_len: int, dtype):
    cache = model.init_cache(max_batch, max_seq_len, dtype)
    index_B = jnp.zeros((max_batch,), jnp.int32, out_sharding=P(model.sharding.tokens[0]))
    return cache._replace(index=index_B)


def _last_logits(model, x_BTM, last_B):
    """float32 [B, V] logits of each row's column `last_B`, V gathered (whole rows)."""
    columns_BT1 = jax.lax.broadcasted_iota(jnp.int32, (*x_BTM.shape[:2], 1), 1)
    x_B1M = jnp.sum(jnp.where(columns_BT1 == last_B[:, None, None], x_BTM, 0), 1, keepdims=True)
    logits_B1V = model.logits(x_B1M)
    return jax.sharding.reshard(logits_B1V[:, 0, :], P(model.sharding.tokens[0], None))


def _drawn(logits_BV, token_B):
    """(token, log p(token), top ids, top log-probs) of float32 logits [B, V] (whole rows)."""
    logprobs_BV = jax.nn.log_softmax(logits_BV.astype(jnp.float32), axis=-1)
    top_BK, ids_BK = jax.lax.top_k(logprobs_BV, min(MAX_LOGPROBS, logprobs_BV.shape[-1]))
    return token_B, pick(logprobs_BV, token_B), ids_BK.astype(jnp.int32), top_BK


def _prompt_scores(model, x_RPM, tokens_RP):
    """PromptScores of every column (as arrays): the LM head over all of them."""
    logits_RPV = model.logits(x_RPM).astype(jnp.float32)
    # Whole rows of the vocabulary, split over the batch as the tokens are: the top-k and the
    # pick below run per row.
    logits_RPV = jax.sharding.reshard(logits_RPV, P(model.sharding.tokens[0], None, None))
    logprobs_RPV = jax.nn.log_softmax(logits_RPV, axis=-1)
    next_RP = jnp.concatenate([tokens_RP[:, 1:], jnp.zeros_like(tokens_RP[:, :1])], axis=1)
    vocab_RPV = jax.lax.broadcasted_iota(jnp.int32, logprobs_RPV.shape, 2)
    picked_RP = jnp.sum(jnp.where(vocab_RPV == next_RP[..., None], logprobs_RPV, 0), axis=-1)
    top_RPK, ids_RPK = jax.lax.top_k(logprobs_RPV, min(MAX_LOGPROBS, logprobs_RPV.shape[-1]))
    return picked_RP, ids_RPK.astype(jnp.int32), top_RPK


def _prefill(graphdef, traces, score, state, cache, tokens_RP, length_R, slot_R, sampling):
    traces["score" if score else "prefill", tokens_RP.shape[1]] += 1
    model = nnx.merge(graphdef, state)
    R, bucket = tokens_RP.shape
    spec = model.sharding.tokens
    columns_RP = jnp.broadcast_to(jnp.arange(bucket, dtype=jnp.int32), (R, bucket))
    columns_RP = jax.sharding.reshard(columns_RP, spec)
    segment_ids_RP = (columns_RP < length_R[:, None]).astype(jnp.int32)
    fresh = model.init_cache(R, bucket, cache.k.dtype)
    x_RPM, fresh, _ = model.hidden(
        tokens_RP, segment_ids=segment_ids_RP, positions=columns_RP, cache=fresh
    )
    logits_RV = _last_logits(model, x_RPM, length_R - 1)
    drawn = _drawn(logits_RV, sample(logits_RV, sampling, length_R))
    scores = _prompt_scores(model, x_RPM, tokens_RP) if score else None
    S = cache.segment_ids.shape[1]
    tail = ((0, 0), (0, S - bucket))

    def put(big, rows):  # rows into the slots' rows, the big array's layout kept
        if big.ndim == 5:  # keys / values [L, B, S, K, D]: the bucket's columns
            return big.at[:, slot_R, :bucket].set(rows, out_sharding=jax.typeof(big).sharding)
        return big.at[slot_R].set(rows, out_sharding=jax.typeof(big).sharding)

    cache = cache._replace(
        k=put(cache.k, fresh.k),
        v=put(cache.v, fresh.v),
        # The whole row: the slot's previous request is masked from here on.
        segment_ids=put(cache.segment_ids, jnp.pad(segment_ids_RP, tail)),
        positions=put(cache.positions, jnp.pad(columns_RP, tail)),
        index=put(cache.index, length_R),
    )
    return cache, (drawn, scores)


def _decode(graphdef, traces, state, cache, token_B, active_B, sampling):
    traces["decode"] += 1
    model = nnx.merge(graphdef, state)
    spec = model.sharding.tokens
    column = lambda x: jax.sharding.reshard(x[:, None], spec)  # noqa: E731
    index_B = cache.index
    x_B1M, new, _ = model.hidden(
        column(token_B),
        segment_ids=column(active_B.astype(jnp.int32)),
        positions=column(index_B),
        cache=cache,
    )
    # A free slot's column stays put (its row is masked; a new request resets it).
    new = new._replace(index=jnp.where(active_B, index_B + 1, index_B))
    logits_BV = _last_logits(model, x_B1M, jnp.zeros_like(index_B))
    return new, _drawn(logits_BV, sample(logits_BV, sampling, index_B + 1))
