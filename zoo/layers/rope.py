"""Rotary position embeddings, half-split convention (Hugging Face's `rotate_half`).

Positions are passed in, never derived from the index, so packed documents restart at 0
and a KV-cache decode step rotates by its true position.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def inverse_frequencies(head_dim: int, theta: float, scaling: tuple | None = None) -> np.ndarray:
    """[D/2] float32. `scaling`: None, (factor,) linear, or Llama 3's 4-tuple."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if scaling is None:
        return inv_freq.astype(np.float32)
    if len(scaling) == 1:
        return (inv_freq / scaling[0]).astype(np.float32)
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
