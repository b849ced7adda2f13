"""Who may attend whom: the segment ids / positions bundle, and the one mask rule.

Query t attends key s iff

    q_ids[t] == kv_ids[s]
    and (not causal or kv_pos[s] <= q_pos[t])
    and (no window or q_pos[t] - kv_pos[s] < sliding_window)

so `sliding_window=w` shows a query itself and the w-1 tokens before it (w visible tokens, the
query included; the window bounds only the past). This is the convention of
`DecoderConfig.sliding_window` and of Hugging Face Mistral / Gemma 3 configs.
`jax.nn.dot_product_attention`'s `local_window_size=(l, 0)` counts differently (l = w - 1).

Segment id 0 is padding (or an empty cache slot). What a padding query sees differs between
backends (the loss ignores it); every backend keeps it finite.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Segments:
    """Segment ids and positions of the queries [B, T] and keys [B, S], and what rows hold.

    Positions advance by one per index within a document (as packing, unpacked rows and KV
    caches make them); kernels that mask by index (splash, cuDNN) rely on it.

    packed: static. True: a row may hold several documents laid end to end, then padding
      (segment ids are needed to keep them apart). False: each row is one document from
      index 0 followed by padding, so the mask reduces to per-row lengths (what the public
      cuDNN call takes). True is always correct; False lets that faster path run. It cannot
      be read off the (traced) ids at trace time, so the caller states it.
    """

    q_ids_BT: jax.Array
    kv_ids_BS: jax.Array
    q_positions_BT: jax.Array
    kv_positions_BS: jax.Array
    packed: bool = True

    @classmethod
    def self_attention(cls, segment_ids_BT, positions_BT, *, packed: bool = True) -> Segments:
        return cls(segment_ids_BT, segment_ids_BT, positions_BT, positions_BT, packed)

    def arrays(self) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        return self.q_ids_BT, self.kv_ids_BS, self.q_positions_BT, self.kv_positions_BS

    def replace(self, **changes) -> Segments:
        return dataclasses.replace(self, **changes)


jax.tree_util.register_dataclass(
    Segments,
    data_fields=["q_ids_BT", "kv_ids_BS", "q_positions_BT", "kv_positions_BS"],
    meta_fields=["packed"],
)


def attention_mask(
    segments: Segments, *, causal: bool, sliding_window: int | jax.Array | None
) -> jax.Array:
    """mask_BTS: True where query t may attend key s (see the module docstring)."""
    mask_BTS = segments.q_ids_BT[:, :, None] == segments.kv_ids_BS[:, None, :]
    q_pos_BT1 = segments.q_positions_BT[:, :, None]
    kv_pos_B1S = segments.kv_positions_BS[:, None, :]
    if causal:
        mask_BTS &= kv_pos_B1S <= q_pos_BT1
    if is_static(sliding_window):
        if sliding_window is not None and sliding_window > 0:
            mask_BTS &= q_pos_BT1 - kv_pos_B1S < sliding_window
    else:
        window = jnp.asarray(sliding_window, jnp.int32)
        mask_BTS &= (window <= 0) | (q_pos_BT1 - kv_pos_B1S < window)
    return mask_BTS


def is_static(sliding_window) -> bool:
    """Whether a window is known at trace time (None or a Python / numpy int)."""
    if isinstance(sliding_window, bool):
        raise TypeError("sliding_window must be None, an int or an int32 scalar, not a bool")
    return sliding_window is None or isinstance(sliding_window, int | np.integer)


def static_window(sliding_window) -> int | None:
    """A static window as a positive int, or None for no window."""
    return int(sliding_window) if sliding_window is not None and sliding_window > 0 else None
