"""Autoregressive generation with the model's KV cache, laid out by the model's strategy.

    with jax.set_mesh(mesh):
        ids = generate(model, [prompt_a, prompt_b], max_new_tokens=64, temperature=0.8, top_k=40)

How a batch of prompts of different lengths runs:
  - Prompts are *left*-padded to the longest, P tokens. Padding has segment id 0 (attended by
    no real token) and real tokens have segment id 1 with positions 0, 1, ... from their own
    first token, so RoPE and the mask see each prompt exactly as if it ran alone; all rows
    then share one cache index, and each decode step writes column P + i for every row.
  - The batch dim of tokens and of the cache is split over `data` (the strategy's `tokens`
    spec), so the number of rows must divide by that axis' size. The batch is padded up to a
    multiple of it by repeating the last prompt; those rows are computed and dropped. (The
    alternative, replicating the batch, would hand every device the whole batch and break the
    declared `B/data` layouts the model's activations are typed with.)
  - One jitted function does the prefill (all P columns in one call) and then a
    `lax.while_loop` of one-token steps, so the loop is compiled once per prompt length /
    budget / sampling setting. The loop stops after `max_new_tokens` or once every row has
    produced `eos_id`.
  - The prefill runs the stacked layers with the layer scan; before the loop the stacked
    weights are sliced into one array per layer, once, so the one-token steps (bound by
    reading the weights) do not copy every layer's slice out of the stack at every step.

Sampling is `zoo.sampling`'s, the server's too: `temperature == 0` is greedy (argmax);
otherwise softmax(logits / temperature), optionally restricted to the `top_k` largest logits,
then to the nucleus of `top_p` (the most likely tokens holding that much probability), in
transformers' order. Row r draws with `seed + r`, keyed by the position the drawn token takes,
so a seeded prompt gives the same text here and from serve_main. Logits are gathered over the
vocab dim first (`V/model` under tensor parallelism) -- one [B, V] array per step -- so
argmax/top-k/top-p run on whole rows, and the random draws are the same on every mesh.

tests/test_generate.py's `greedy_reference` recomputes the whole sequence without the cache
at every step; it is the oracle the KV-cache path is tested against.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnx_zoo.errors import UsageError
from shardings import get_strategy
from shardings.specs import split_size
from zoo import sampling
from zoo.layers.lora import has_lora
from zoo.sampling import SamplingRows, sample


def check_can_generate(strategy_name: str, what: str = "--prompt") -> None:
    """UsageError (one line, starting with `what`) for a strategy generation cannot run under:
    a pipeline's, or one that splits the sequence (context parallelism), checked by name
    before any model is built."""
    sharding = get_strategy(strategy_name).lm_sharding()
    if sharding.stage_axis is not None:
        raise UsageError(
            f"{what}: generation (KV-cache decoding) does not run under the pipeline "
            f"strategy {strategy_name}; add --sharding_strategy=fsdp (or another without a "
            "`stage` axis): checkpoints load under any strategy"
        )
    split_T = _sequence_axis(sharding.tokens)
    if split_T is not None:
        raise UsageError(
            f"{what}: {_no_context_split(split_T)} (the context-parallel strategy "
            f"{strategy_name}); add --sharding_strategy=fsdp (or another without a `context` "
            "axis): checkpoints load under any strategy"
        )
    split_residual = _sequence_axis(sharding.block.residual)
    if split_residual is not None:
        raise UsageError(
            f"{what}: generation (KV-cache decoding) does not split the residual stream's "
            f"sequence over `{split_residual}` (the sequence-parallel strategy "
            f"{strategy_name}); add --sharding_strategy=fsdp_tp (the same weight layouts): "
            "checkpoints load under any strategy"
        )


def _sequence_axis(tokens_spec: P):
    """The mesh axis the tokens' sequence dim is split over (None: not split)."""
    return tokens_spec[1] if len(tokens_spec) > 1 else None


def _no_context_split(axis) -> str:
    return f"generation does not split the sequence over {axis!r}"


def model_mesh(model):
    """The mesh the model's parameters live on (the one it was built under)."""
    return jax.tree.leaves(nnx.state(model, nnx.Param))[0].sharding.mesh


def batch_multiple(model, mesh) -> int:
    """How many rows the batch must divide by: the mesh size of the tokens' batch dim."""
    return split_size(model.sharding.tokens, 0, mesh.shape)


def _pad_rows(rows: list, multiple: int) -> list:
    return rows + [rows[-1]] * (-len(rows) % multiple)


def left_pad(prompts: Sequence[Sequence[int]], length: int):
    """(tokens, segment_ids, positions), int32 [B, length]: each prompt at the right end."""
    B = len(prompts)
    tokens = np.zeros((B, length), np.int32)
    segment_ids = np.zeros((B, length), np.int32)
    positions = np.zeros((B, length), np.int32)
    for row, prompt in enumerate(prompts):
        n = len(prompt)
        tokens[row, length - n :] = prompt
        segment_ids[row, length - n :] = 1
        positions[row, length - n :] = np.arange(n)
    return tokens, segment_ids, positions


def _last_logits(logits_BTV, batch_spec: P):
    """The last column's logits, gathered over the vocab dim: [B, V] laid out `B/data V`."""
    return jax.sharding.reshard(logits_BTV[:, -1, :], P(batch_spec[0], None))


def layer_list(model):
    """(graphdef, state) of `model` with its stacked layers as a list of per-layer weights.

    A decode step runs each layer's matmuls on one row, so it is bound by reading the weights;
    under the layer scan every step first copies each layer's slice out of the stacked [L, ...]
    arrays (a dynamic-slice XLA cannot fold into the dot), which triples the memory traffic.
    Slicing them once, before the decode loop, leaves the loop only the reads. The numbers do
    not change: same weights, same per-layer computation.
    """
    cfg = model.cfg
    if not cfg.scan_layers or has_lora(model):
        # The twin is built from the config alone, so it would lack adapters added to this
        # model after construction (zoo/layers/lora.py): such a model decodes through the scan.
        return nnx.split(model)
    twin_cfg = dataclasses.replace(cfg, scan_layers=False)
    twin = nnx.eval_shape(lambda: type(model)(twin_cfg, model.sharding, rngs=nnx.Rngs(0)))
    twin_graphdef, twin_state = nnx.split(twin)
    stacked = dict(nnx.to_flat_state(nnx.state(model)))
    leaves = []
    for path, var in nnx.to_flat_state(twin_state):
        if path in stacked:  # outside the stacks, or a list in both (MTP's `mtp_blocks`)
            value = stacked[path][...]
        elif len(path) > 1 and isinstance(path[1], int):  # ('blocks', i, ...) <- ('blocks', ...)[i]
            value = stacked[(path[0], *path[2:])][...][path[1]]
        else:
            value = stacked[path][...]
        leaves.append((path, var.replace(value)))
    return twin_graphdef, nnx.from_flat_state(leaves)


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "max_new_tokens", "eos_id"),
)
def _generate(
    graphdef,
    state,
    tokens_BP,
    segment_ids_BP,
    positions_BP,
    sampling: SamplingRows,
    *,
    max_new_tokens: int,
    eos_id: int | None,
):
    model = nnx.merge(graphdef, state)
    spec = model.sharding.tokens
    B, prompt_len = tokens_BP.shape
    cache = model.init_cache(B, prompt_len + max_new_tokens)
    logits_BPV, cache, _ = model.forward(
        tokens_BP, segment_ids=segment_ids_BP, positions=positions_BP, cache=cache
    )
    # Next position of each row: its prompt length (left padding has positions 0). A token is
    # drawn keyed by the position it takes, as the server draws (zoo/sampling.py).
    position_B = positions_BP[:, -1] + 1
    token_B = sample(_last_logits(logits_BPV, spec), sampling, position_B)
    # The prefill above keeps the layer scan (one compiled block; its weight copies are shared
    # by P tokens); the one-token steps below run the layers as a list.
    graphdef, state = layer_list(model)
    out_BO = jnp.full((B, max_new_tokens), -1, jnp.int32, out_sharding=spec)
    done_B = jnp.zeros((B,), bool, out_sharding=P(spec[0]))
    eos = -2 if eos_id is None else eos_id  # never matches a token when there is no EOS

    def emit(i, token_B, done_B, out_BO):
        """Write token i (-1 for rows already finished); mark rows that just produced EOS."""
        out_BO = out_BO.at[:, i].set(jnp.where(done_B, -1, token_B))
        return done_B | (token_B == eos), out_BO

    # The parameters ride in the carry: an NNX module must be merged at the trace level that
    # uses it (nnx.scan inside the model rejects variables closed over from outside the loop).
    def cond(carry):
        i, token_B, _, _, done_B, _, _ = carry
        return (i < max_new_tokens - 1) & ~jnp.all(done_B | (token_B == eos))

    def body(carry):
        i, token_B, cache, position_B, done_B, out_BO, state = carry
        done_B, out_BO = emit(i, token_B, done_B, out_BO)
        model = nnx.merge(graphdef, state)
        step = lambda x: jax.sharding.reshard(x[:, None], spec)  # noqa: E731
        logits_B1V, cache, _ = model.forward(
            step(token_B),
            segment_ids=step(jnp.ones_like(token_B)),
            positions=step(position_B),
            cache=cache,
        )
        token_B = sample(_last_logits(logits_B1V, spec), sampling, position_B + 1)
        return i + 1, token_B, cache, position_B + 1, done_B, out_BO, state

    carry = (jnp.int32(0), token_B, cache, position_B, done_B, out_BO, state)
    i, token_B, _, _, done_B, out_BO, _ = jax.lax.while_loop(cond, body, carry)
    _, out_BO = emit(i, token_B, done_B, out_BO)
    return out_BO


def generate(
    model,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | None = None,
    seed: int = 0,
    prompt_len: int | None = None,
) -> list[list[int]]:
    """Continue each prompt (a list of token ids) by up to `max_new_tokens` ids.

    Returns, per prompt, the new ids up to (not including) the first `eos_id`. Runs on the
    mesh the model's parameters live on. `prompt_len`: left-pad the prompts to at least this
    many columns (callers with many batches bucket their lengths, so fewer shapes compile).
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise UsageError("generate needs at least one prompt, each of at least one token")
    if max_new_tokens < 1:
        raise UsageError(f"max_new_tokens={max_new_tokens} must be >= 1")
    if not math.isfinite(temperature) or temperature < 0:
        raise UsageError(f"temperature={temperature} must be a number >= 0 (0: greedy)")
    if top_k is not None and top_k < 1:
        raise UsageError(f"top_k={top_k} must be >= 1 (or None: the whole vocabulary)")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise UsageError(f"top_p={top_p} must be in (0, 1] (or None: the whole vocabulary)")
    cfg = model.cfg
    vocab = cfg.vocab_size
    bad = [t for p in prompts for t in p if not 0 <= int(t) < vocab]
    if bad:
        raise UsageError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
    prompt_len = max(max(len(p) for p in prompts), prompt_len or 0)
    if prompt_len + max_new_tokens > cfg.max_seq_len:
        raise UsageError(
            f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
            f"model's max_seq_len={cfg.max_seq_len}"
        )
    mesh = model_mesh(model)
    split_T = _sequence_axis(model.sharding.tokens)
    if split_T is not None:
        raise UsageError(
            f"{_no_context_split(split_T)} (a context-parallel strategy): generate with a "
            "strategy without context, e.g. --sharding_strategy=fsdp"
        )
    rows = _pad_rows([list(p) for p in prompts], batch_multiple(model, mesh))
    sharding = NamedSharding(mesh, model.sharding.tokens)
    arrays = [jax.device_put(a, sharding) for a in left_pad(rows, prompt_len)]
    per_row = NamedSharding(mesh, P(model.sharding.tokens[0]))
    settings = sampling.rows(
        len(rows), temperature=temperature, top_k=top_k, top_p=top_p, seed=seed
    )
    settings = SamplingRows(*(jax.device_put(a, per_row) for a in settings))
    graphdef, state = nnx.split(model)
    with jax.set_mesh(mesh):
        out_BO = _generate(
            graphdef, state, *arrays, settings, max_new_tokens=max_new_tokens, eos_id=eos_id
        )
    out_BO = np.asarray(jax.device_get(out_BO))[: len(prompts)]
    results = []
    for row in out_BO:
        ids = row.tolist()
        stop = ids.index(-1) if -1 in ids else len(ids)
        ids = ids[:stop]
        if eos_id is not None and eos_id in ids:
            ids = ids[: ids.index(eos_id)]
        results.append(ids)
    return results
