"""What only an NVIDIA GPU shows: cuDNN attention's numbers, offload remat run for real, speed.

    python -m bench.gpu_check                 # on a machine with one or more NVIDIA GPUs
    python -m bench.gpu_check --skip_speed    # numerics only (a minute)

1. The `cudnn` attention backend against the `xla` one, both in bfloat16, each compared with
   the float32 `xla` result on the same bf16-rounded inputs: forward output and the gradients
   of q, k, v, for packed rows (document mask as a bias) and unpacked rows (lengths), GQA,
   head dims 64 and 128. cuDNN is right when its error is of the same order as XLA's own
   bf16 error (both round the probabilities and the output to bf16); the HLO must hold the
   cuDNN fused-attention custom call.
2. A Llama (L=4, M=512, bf16 compute) whose only difference is `attention_impl` (cudnn vs
   xla): loss and gradient norm of the same batch.
3. remat='offload' against remat='full' on the same model: the same loss and gradients (the
   offloaded residuals come back bit-equal), the compiled step's host and device bytes.
4. Unless --skip_speed (and first, in child processes): bench/train_throughput.py's
   measurement (the train step train_main runs) for configs/llama3_1b.py at --batch x
   --seq_len on one GPU, attention `auto` (cuDNN) and `xla`: tokens/s and MFU against the
   chip's dense bf16 peak.

Prints one JSON object per check and exits 1 if a numerical check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# cuDNN may differ from XLA by a few bf16 ulps more than XLA differs from float32; beyond this
# factor (plus a floor for near-zero gradients) it computes something else.
ERROR_FACTOR = 4.0
ERROR_FLOOR = 2e-3


def _report(row: dict) -> None:
    print(json.dumps(row), flush=True)


def _rows(packed: bool, T: int):
    """Segment ids and positions: packed rows hold documents of 300, 500, 224 and of 700 then
    324 padding; unpacked rows are one document from 0 of lengths 1024 and 611."""
    import numpy as np

    from bench.fixtures import packed_rows

    seg, pos = packed_rows(([300, 500, 224], [700]) if packed else ([T], [611]), T)
    if not packed:
        pos[:] = np.arange(T)  # unpacked: positions run on through the padding
    return seg, pos


def _attention_case(packed: bool, D: int) -> bool:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from zoo.layers.attention import Segments, attention

    B, T, N, K = 2, 1024, 8, 2
    rng = np.random.default_rng(D)
    q, k, v = (jnp.asarray(rng.standard_normal((B, T, h, D)), jnp.bfloat16) for h in (N, K, K))
    seg, pos = _rows(packed, T)
    segments = Segments.self_attention(jnp.asarray(seg), jnp.asarray(pos), packed=packed)
    visible = jnp.asarray(seg > 0)[:, :, None, None]
    weights = jnp.cos(jnp.arange(D, dtype=jnp.float32))

    def run(impl, dtype):
        def loss(q, k, v):
            out = attention(
                q.astype(dtype),
                k.astype(dtype),
                v.astype(dtype),
                segments,
                scale=D**-0.5,
                out_sharding=None,
                implementation=impl,
            )
            # Padding queries are left out: their value is a convention, not attention.
            out = jnp.where(visible, out.astype(jnp.float32), 0.0)
            return jnp.sum(out * weights), out

        fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
        compiled = fn.lower(q, k, v).compile()
        (_, out), grads = compiled(q, k, v)
        return out, grads, compiled.as_text()

    ref_out, ref_grads, _ = run("xla", jnp.float32)
    errors, kernel = {}, {}
    for impl in ("xla", "cudnn"):
        out, grads, text = run(impl, jnp.bfloat16)
        kernel[impl] = "__cudnn$fmha" in text
        errors[impl] = {
            name: float(jnp.max(jnp.abs(a.astype(jnp.float32) - r)))
            for name, a, r in zip(
                ("out", "dq", "dk", "dv"), (out, *grads), (ref_out, *ref_grads), strict=True
            )
        }
    passed = kernel["cudnn"] and all(
        errors["cudnn"][n] <= ERROR_FACTOR * errors["xla"][n] + ERROR_FLOOR for n in errors["xla"]
    )
    _report(
        {
            "check": "attention cudnn vs xla (max abs error vs float32)",
            "packed": packed,
            "shape": f"B{B} T{T} N{N} K{K} D{D}",
            "cudnn_kernel_in_hlo": kernel["cudnn"],
            "xla_bf16": errors["xla"],
            "cudnn_bf16": errors["cudnn"],
            "pass": passed,
        }
    )
    return passed


def attention_numerics() -> bool:
    return all([_attention_case(packed, D) for packed in (True, False) for D in (64, 128)])


def _model_and_batch(**cfg_changes):
    import jax
    import numpy as np
    from flax import nnx

    from shardings import get_strategy
    from zoo import create_model, get_config

    cfg = get_config(
        "tiny",
        vocab_size=4096,
        hidden_dim=512,
        num_layers=4,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        ffn_dim=1536,
        max_seq_len=2048,
        dtype="bfloat16",
    ).replace(**cfg_changes)
    strategy = get_strategy("fsdp_tp")
    mesh = strategy.make_mesh(config=cfg)
    with jax.set_mesh(mesh):
        model = create_model(cfg, strategy, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    B, T = 8, 2048
    tokens = rng.integers(0, cfg.vocab_size, (B, T), dtype=np.int32)
    seg = np.ones((B, T), np.int32)
    pos = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)).copy()
    seg[:, T // 2 :] = 2  # two documents per row: the packed (mask) path
    pos[:, T // 2 :] -= T // 2
    batch = {"tokens": tokens, "segment_ids": seg, "positions": pos}
    with jax.set_mesh(mesh):
        batch = {k: jax.device_put(v, strategy.batch_spec()) for k, v in batch.items()}
    return model, mesh, batch


def _loss_and_grads(model, mesh, batch):
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from nnx_zoo.training.loop import loss_sum

    graphdef, state = nnx.split(model)

    def step(state):
        def mean_loss(model):
            total, count = loss_sum(model, batch)
            return total / count

        return nnx.value_and_grad(mean_loss)(nnx.merge(graphdef, state))

    with jax.set_mesh(mesh):
        compiled = jax.jit(step).lower(state).compile()
        loss, grads = compiled(state)
        leaves = [jnp.asarray(g, jnp.float32) for g in jax.tree.leaves(grads)]
        return float(loss), float(optax.global_norm(leaves)), leaves, compiled


def model_cudnn_vs_xla() -> bool:
    losses = {}
    for impl in ("xla", "cudnn"):
        model, mesh, batch = _model_and_batch(attention_impl=impl)
        loss, norm, _, _ = _loss_and_grads(model, mesh, batch)
        losses[impl] = (loss, norm)
    (lx, nx), (lc, nc) = losses["xla"], losses["cudnn"]
    # bf16 compute: the two paths round differently inside attention; a loss of ~8.3 agrees to
    # a few 1e-3 and the gradient norm to ~1%.
    passed = abs(lx - lc) <= 1e-2 and abs(nx - nc) <= 0.02 * nx
    _report(
        {
            "check": "llama L4 M512 bf16 8x2048 packed: cudnn vs xla",
            "loss": {"xla": lx, "cudnn": lc},
            "grad_norm": {"xla": nx, "cudnn": nc},
            "pass": passed,
        }
    )
    return passed


def offload_vs_full() -> bool:
    import jax
    import numpy as np

    out = {}
    for remat in ("full", "offload"):
        model, mesh, batch = _model_and_batch(attention_impl="cudnn", remat=remat)
        loss, norm, leaves, compiled = _loss_and_grads(model, mesh, batch)
        memory = compiled.memory_analysis()
        out[remat] = (loss, norm, [np.asarray(x) for x in jax.device_get(leaves)], memory)
    lf, nf, gf, mf = out["full"]
    lo, no, go, mo = out["offload"]
    same = lf == lo and all(np.array_equal(a, b) for a, b in zip(gf, go, strict=True))
    close = abs(lf - lo) <= 1e-3 and abs(nf - no) <= 1e-3 * nf

    def mem(m):
        keys = ("temp_size_in_bytes", "host_temp_size_in_bytes", "argument_size_in_bytes")
        return {k: int(getattr(m, k, 0) or 0) for k in keys}

    _report(
        {
            "check": "remat offload vs full (cudnn, bf16)",
            "loss": {"full": lf, "offload": lo},
            "grad_norm": {"full": nf, "offload": no},
            "bit_equal": same,
            "memory": {"full": mem(mf), "offload": mem(mo)},
            "pass": close,
        }
    )
    return close


def speed(seq_len: int, batch: int, steps: int, timeout: int) -> None:
    """Each run in its own process, before this one touches the GPU: a JAX process takes 75%
    of the GPU's memory when it starts, which would leave the child too little."""
    for impl in ("auto", "xla"):
        argv = [
            sys.executable,
            "-m",
            "bench.train_throughput",
            "--child",
            "--config=llama3_1b",
            "--strategies=fsdp_tp",
            f"--steps={steps}",
            "--warmup=2",
            f"--override=data.seq_len={seq_len}",
            f"--override=data.global_batch_size={batch}",
            f"--override=model.attention_impl={impl}",
            "--override=data.num_workers=0",
        ]
        try:
            result = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=timeout)
            rows = [json.loads(x) for x in result.stdout.splitlines() if x.startswith("{")]
            tail = result.stderr[-1500:] if result.returncode else ""
        except subprocess.TimeoutExpired:
            rows, tail = [], f"timed out after {timeout} s"
        keep = ("batch", "step_s", "tokens_per_s", "mfu", "peak_tflops_total", "compile_s", "loss")
        _report(
            {
                "check": f"train step llama3_1b {batch}x{seq_len} bf16 attention={impl}",
                **({k: rows[0].get(k) for k in keep} if rows else {"failed": tail}),
            }
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip_speed", action="store_true")
    parser.add_argument("--skip_numerics", action="store_true")
    parser.add_argument("--seq_len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--timeout", type=int, default=300, help="seconds per speed run")
    args = parser.parse_args()
    if not args.skip_speed:
        speed(args.seq_len, args.batch, args.steps, args.timeout)
    if args.skip_numerics:
        return
    import jax

    devices = jax.devices()
    _report({"jax": jax.__version__, "devices": [d.device_kind for d in devices]})
    if devices[0].platform not in ("gpu", "cuda"):
        print("error: no NVIDIA GPU visible to jax; this bench needs one", file=sys.stderr)
        sys.exit(2)
    ok = True
    for check in (attention_numerics, model_cudnn_vs_xla, offload_vs_full):
        try:
            ok &= check()
        except Exception:  # noqa: BLE001 - report and go on to the next check
            import traceback

            _report({"check": check.__name__, "error": traceback.format_exc()[-3000:]})
            ok = False
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
