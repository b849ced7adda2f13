"""Model FLOPs per token, devices' peak FLOP/s, and MFU.

Model FLOPs utilisation (MFU) = achieved model FLOP/s / peak FLOP/s, where "model FLOPs" are
those the architecture needs for a training step (forward + backward), counted from the config,
not those the compiled program happens to execute (rematerialisation is not counted).

Training FLOPs per token, decoder-only LM (letters as in the rest of the project: L layers,
M hidden, N query heads, K kv heads, D head dim, F ffn, V vocab, T sequence length):

1. Matmul weights (PaLM / Chinchilla convention). A matmul with a weight of P entries costs
   2P FLOPs per token forward (a multiply and an add per entry), and 4P backward (gradients
   with respect to the input and to the weight), so 6P per token for training.
       N_matmul = L * (M*N*D + 2*M*K*D + N*D*M      q, k, v, o projections
                       + (3 if GLU else 2) * M*F)   gate+up+down, or up+down
                  + M*V                              LM head
   The LM head counts even when tied to the embedding: it is a matmul either way. The
   embedding *lookup* is a gather, not a matmul, and counts 0. Norm gains, biases and
   elementwise work (softmax, activations, RoPE) are left out, as usual.
       6 * N_matmul

2. Attention scores and values. For one query token, one layer, one head: q.k over C keys
   costs 2*C*D FLOPs and the weighted sum of C values another 2*C*D, so 4*C*N*D per token per
   layer forward (N query heads: GQA shares k/v but each query head still does its own
   products), and 12*C*N*D for training (backward = 2 x forward, as for any matmul).
   Full (bidirectional) attention has C = T. Causal attention computes only the lower
   triangle: the query at position t (1-based) sees t keys, so C is the mean over t of t,
   exactly (T+1)/2 -- "half", i.e. about 6*T*N*D per token per layer, where PaLM's
   12*L*H*Q*T counts the full square. With a sliding window of w visible keys (the query
   itself and the w-1 before it, as zoo/layers/attention/ defines it), the query at t
   sees min(t, w), and with w' = min(T, w):
       C = (1/T) * sum_{t=1..T} min(t, w') = (w'(w'+1)/2 + (T - w') * w') / T
   which is (T+1)/2 when w >= T. Layers may differ (local/global interleaving): the sum runs
   over each layer's own C. T is the packed row's length: documents packed in a row do not
   attend to each other, but an XLA/cuDNN kernel still computes the row's whole triangle, and
   MFU conventionally counts the model at its sequence length, not its documents'.

   flops_per_token = 6 * N_matmul + 12 * N * D * sum_over_layers C_layer
                   = 6 * N_matmul + 6 * L * (T+1) * N * D      (causal, no window)

The count itself is the model config's (`DecoderConfig.flops_per_token`, with
`matmul_params` and `causal_keys_per_query` in zoo/layers/config.py), so there is one formula;
this module holds the hardware side: peak FLOP/s and MFU.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from nnx_zoo.errors import UsageError

# Dense (no sparsity) peak FLOP/s per device, from the vendors' data sheets: the one table of
# chip peaks (nnx_zoo/planning/chips.py takes its chips' figures from here). Looked up by
# substring of `jax.Device.device_kind`, first match wins, so more specific names come first
# ('TPU v5 lite' before 'TPU v5', 'H100 PCIe' before 'H100').
# float32: on GPUs, XLA runs float32 matmuls as TF32 by default (jax's default matmul
# precision), half the bf16 rate; on TPUs, default precision runs float32 matmuls as one bf16
# pass, so the bf16 rate applies.
# fp8 / int8: matmuls on those operands (model.quantization); None: no faster path than bf16,
# the quantized dot runs at the bf16 rate (fp8 on TPU v5 / v6).
# Sources:
# [h100] nvidia.com/en-us/data-center/h100 (SXM): 989 TFLOP/s bf16, FP8 1979 TFLOP/s and INT8
#   1979 TOPS dense (3958 with sparsity); PCIe: 756 bf16, 1513 FP8 / INT8.
# [h200] nvidia.com/en-us/data-center/h200 (SXM): as the H100 SXM.
# [a100] nvidia.com/en-us/data-center/a100: 312 TFLOP/s bf16, INT8 624 TOPS, no FP8.
# [tpu-v4] cloud.google.com/tpu/docs/v4: 275 TFLOP/s bf16 and int8.
# [tpu-v5p] / [tpu-v5e] / [tpu-v6e] cloud.google.com/tpu/docs/v5p, /v5e, /v6e: bf16 459 / 197 /
#   918 TFLOP/s, int8 918 / 394 / 1836 TOPS; no fp8 MXU rate.


@dataclasses.dataclass(frozen=True)
class Peak:
    kinds: tuple[str, ...]  # `jax.Device.device_kind` substrings
    bf16: float
    float32: float
    fp8: float | None = None
    int8: float | None = None

    def at(self, quantization: str = "none") -> float:
        """The projections' peak at `quantization` (model.quantization): fp8 / int8 where the
        chip has a faster rate for them, else bf16's."""
        return {"fp8": self.fp8, "int8": self.int8}.get(quantization) or self.bf16


PEAKS: dict[str, Peak] = {
    "h100_pcie": Peak(("H100 PCIe",), 756e12, 378e12, fp8=1513e12, int8=1513e12),  # [h100]
    "h100": Peak(("H100",), 989e12, 494.5e12, fp8=1979e12, int8=1979e12),  # [h100] SXM
    "h200": Peak(("H200",), 989e12, 494.5e12, fp8=1979e12, int8=1979e12),  # [h200]
    "a100": Peak(("A100",), 312e12, 156e12, int8=624e12),  # [a100]
    "v4": Peak(("TPU v4",), 275e12, 275e12),  # [tpu-v4]
    "v5e": Peak(("TPU v5 lite", "TPU v5e"), 197e12, 197e12, int8=394e12),  # [tpu-v5e]
    "v5p": Peak(("TPU v5p", "TPU v5"), 459e12, 459e12, int8=918e12),  # [tpu-v5p]
    "v6e": Peak(("TPU v6 lite", "TPU v6e", "TPU v6"), 918e12, 918e12, int8=1836e12),  # [tpu-v6e]
}


def peak_name(device_kind: str) -> str | None:
    """The PEAKS key of a `device_kind` string, or None if not in the table."""
    for name, peak in PEAKS.items():
        if any(k.lower() in device_kind.lower() for k in peak.kinds):
            return name
    return None


def lookup_peak_flops(device_kind: str, dtype=jnp.bfloat16) -> float | None:
    """Peak FLOP/s for a `device_kind` string and compute dtype, or None if not in the table."""
    name = peak_name(device_kind)
    if name is None:
        return None
    return PEAKS[name].bf16 if jnp.dtype(dtype).itemsize <= 2 else PEAKS[name].float32


def precision_peak_ratio(device: jax.Device, quantization: str) -> float:
    """Peak at `quantization` over the bf16 peak for a real device (1 where unknown: CPU)."""
    name = None if device.platform == "cpu" else peak_name(device.device_kind)
    return 1.0 if name is None else PEAKS[name].at(quantization) / PEAKS[name].bf16


@functools.cache
def measure_cpu_peak_flops(size: int = 1024, repeats: int = 10, dtype=jnp.float32) -> float:
    """FLOP/s per CPU device: the best of `repeats` jitted `size`^2 matmuls, over the devices.

    Simulated CPU devices (`--xla_force_host_platform_device_count`) share the host's cores,
    and one matmul already uses all of them, so the host's rate is divided by the number of
    local CPU devices: the sum over devices is then the machine's rate, as MFU needs.
    Cached: measured once per process; a 1024^2 matmul keeps that cheap at the start of a
    run and reads a little below larger sizes, so the MFU it divides is a rough CPU figure.
    """
    device = jax.local_devices(backend="cpu")[0]
    key_a, key_b = jax.random.split(jax.random.key(0))
    a = jax.device_put(jax.random.normal(key_a, (size, size), dtype), device)
    b = jax.device_put(jax.random.normal(key_b, (size, size), dtype), device)
    matmul = jax.jit(jnp.matmul)
    matmul(a, b).block_until_ready()  # compile and warm up
    best = np.inf
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a, b).block_until_ready()
        best = min(best, time.perf_counter() - start)
    host_flops = 2.0 * size**3 / best
    return host_flops / len(jax.local_devices(backend="cpu"))


def peak_flops_per_device(
    device: jax.Device, dtype=jnp.bfloat16, override_tflops: float | None = None
) -> float:
    """Peak FLOP/s of one `device` for matmuls in `dtype`.

    `override_tflops` (e.g. from `--peak_tflops`) wins; CPUs are measured
    (`measure_cpu_peak_flops`, in `dtype`); accelerators come from `PEAKS`. An accelerator
    not in the table raises UsageError, naming the kind and the override to use.
    """
    if override_tflops is not None:
        if override_tflops <= 0:
            raise UsageError(f"peak TFLOP/s must be positive, got {override_tflops}")
        return override_tflops * 1e12
    if device.platform == "cpu":
        return measure_cpu_peak_flops(dtype=dtype)
    peak = lookup_peak_flops(device.device_kind, dtype)
    if peak is None:
        known = ", ".join(k for peak in PEAKS.values() for k in peak.kinds)
        raise UsageError(
            f"no peak FLOP/s known for device kind {device.device_kind!r} (known: {known}); "
            "give it with --peak_tflops"
        )
    return peak


def mfu(
    tokens_per_second_global: float,
    flops_per_token: float,
    num_devices: int,
    peak_per_device: float,
) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the peak of all `num_devices`."""
    return tokens_per_second_global * flops_per_token / (num_devices * peak_per_device)
