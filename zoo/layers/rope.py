"""Rotary position embeddings, half-split convention (Hugging Face's `rotate_half`).

Positions are passed in, never derived from the index, so packed documents restart at 0
and a KV-cache decode step rotates by its true position.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

# A YaRN `rope_scaling` has this many entries: (factor, beta_fast, beta_slow,
# original_max_position_embeddings, truncate), as transformers' `_compute_yarn_parameters`
# reads them (GPT-OSS).
YARN_ENTRIES = 5


def inverse_frequencies(head_dim: int, theta: float, scaling: tuple | None = None) -> np.ndarray:
    """[D/2] float32. `scaling`: None, (factor,) linear, Llama 3's 4-tuple or YaRN's 5-tuple."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if scaling is None:
        return inv_freq.astype(np.float32)
    if len(scaling) == 1:
        return (inv_freq / scaling[0]).astype(np.float32)
    if len(scaling) == YARN_ENTRIES:
        return yarn_inverse_frequencies(head_dim, theta, *scaling)
    factor, low_freq_factor, high_freq_factor, original_context = scaling
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the band in
    # between interpolated, so the model extends past its original context.
    low_freq_wavelen = original_context / low_freq_factor
    high_freq_wavelen = original_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def yarn_inverse_frequencies(
    head_dim: int,
    theta: float,
    factor: float,
    beta_fast: float,
    beta_slow: float,
    original_context: int,
    truncate: bool,
) -> np.ndarray:
    """YaRN (arXiv 2309.00071) as transformers computes it: frequencies that turn fewer than
    `beta_slow` times over the original context are interpolated (divided by `factor`), those
    that turn more than `beta_fast` times kept, a linear ramp between. In float32, as
    transformers computes the ramp, so the tables agree to the last bit where they can."""
    D = head_dim

    def correction_dim(rotations):
        return D * math.log(original_context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, D - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    pos_freqs = np.float32(theta) ** (np.arange(0, D, 2, dtype=np.float32) / np.float32(D))
    ramp = np.clip((np.arange(D // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = (1 - ramp).astype(np.float32)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    return inv_freq.astype(np.float32)


def attention_factor(scaling: tuple | None) -> float:
    """What YaRN multiplies cos and sin by (so q and k; transformers' `attention_scaling`):
    0.1 ln(factor) + 1 for a factor above 1; 1 for every other scaling."""
    if scaling is None or len(scaling) != YARN_ENTRIES or scaling[0] <= 1:
        return 1.0
    return 0.1 * math.log(scaling[0]) + 1.0


def rotate(x_BTND, positions_BT, inv_freq_R):
    """Rotate q or k ([B, T, N or K, D]) by `positions`; math in float32. `inv_freq_R`: the
    D/2 rotary frequencies."""
    with jax.named_scope("rope"):  # profiles and bench/step_breakdown.py read the name
        return _rotate(x_BTND, positions_BT, inv_freq_R)


def _rotate(x_BTND, positions_BT, inv_freq_R):
    angles_BTR = positions_BT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq_R)
    cos = jnp.cos(angles_BTR)[:, :, None, :]
    sin = jnp.sin(angles_BTR)[:, :, None, :]
    x = x_BTND.astype(jnp.float32)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x_BTND.dtype)
