"""KV-cache bytes per token: multi-head latent attention's latent against expanded keys and
values and against grouped-query attention of the same width.

    python -m bench.mla_cache                    # deepseek-v3, bfloat16 cache
    python -m bench.mla_cache --model=deepseek-v3-tiny --dtype=float32

Each row is measured from a cache `init_cache` builds (shapes only, `jax.eval_shape`: nothing
is allocated): DeepSeek-V3's (the latent C and the shared rotary key r per token and layer),
the keys and values MLA would cache expanded (N (D_qk + D_v) per token and layer, what a cache of
the attention's inputs would hold), and a Llama-style GQA model of the same M, L, N with 8
and with 16 kv heads of 128. Bytes per token sum every layer.
"""

from __future__ import annotations

import argparse

import jax
from flax import nnx

from shardings import get_strategy
from zoo import create_model, get_config


def cache_bytes_per_token(cfg, dtype: str) -> int:
    """Bytes per token of the cache the model of `cfg` builds (all layers, one row)."""
    strategy = get_strategy("dp")
    mesh = strategy.make_mesh(shape=(1,), devices=jax.devices()[:1])
    S = 64
    with jax.set_mesh(mesh):
        model = nnx.eval_shape(lambda: create_model(cfg, strategy, rngs=nnx.Rngs(0)))
        cache = jax.eval_shape(lambda: model.init_cache(1, S, dtype))
    return (cache.k.size * cache.k.dtype.itemsize + cache.v.size * cache.v.dtype.itemsize) // S


def rows(model: str, dtype: str) -> list[tuple[str, int, int]]:
    """(what, bytes per token, bytes per token and layer)."""
    mla = get_config(model)
    L, M, N = mla.num_layers, mla.hidden_dim, mla.num_heads
    itemsize = jax.numpy.dtype(dtype).itemsize
    out = [(f"{model}: latent C={mla.kv_lora_rank} + rotary key r={mla.qk_rope_head_dim}",)]
    out[0] += (cache_bytes_per_token(mla, dtype),)
    expanded = L * N * (mla.head_dim + mla.v_head_dim) * itemsize
    what = f"{model} expanded: {N} heads' keys x {mla.head_dim}, values x {mla.v_head_dim}"
    out.append((what, expanded))
    D = 128 if M % 128 == 0 else M // N  # heads of 128 where M allows (Llama's)
    heads = M // D
    for kv_heads in (8, heads):
        if heads % kv_heads:
            continue
        gqa = get_config("llama3.1-8b").replace(
            vocab_size=mla.vocab_size,
            hidden_dim=M,
            num_layers=L,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=D,
        )
        kind = "MHA" if kv_heads == heads else "GQA"
        what = f"{kind}, M={M}, L={L}: {heads} heads, {kv_heads} kv heads x {D}"
        out.append((what, cache_bytes_per_token(gqa, dtype)))
    return [(what, total, total // L) for what, total in out]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="deepseek-v3")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args(argv)
    table = rows(args.model, args.dtype)
    latent = table[0][1]
    print(f"{'cache':<64} {'bytes/token':>12} {'per layer':>10} {'x latent':>9}")
    for what, total, per_layer in table:
        print(f"{what:<64} {total:>12,} {per_layer:>10,} {total / latent:>9.1f}")


if __name__ == "__main__":
    main()
