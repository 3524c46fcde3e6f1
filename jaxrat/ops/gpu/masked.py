"""Attention with a key padding mask (DETR's cross-attention over a letterboxed image) as one
fused call: each row's kept keys are gathered to the front and masked by length.

A letterboxed image's padding is at its right and bottom, so in row-major token order the padded
keys are interleaved with the real ones; cuDNN masks only a row's tail (``key_value_seq_lengths``)
unless given a materialised bias. One stable gather per row puts the kept keys first, in order
(softmax does not care about key order), and the count of kept keys is the row's length.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrat.ops.gpu.fused import Implementation, fused_attention
from jaxrat.ops.gpu.permute import inverse_order, permute_keys

Array = jax.Array


def masked_attention(
    q: Array, k: Array, v: Array, key_ok: Array, *, scale: float = 1.0, implementation: Implementation = "auto"
) -> Array:
    """``softmax(scale * q k^T, keys where key_ok) v`` over the last two axes.

    Args:
      q: (..., Nq, dqk) queries.
      k: (..., Nk, dqk) keys.
      v: (..., Nk, dv) values.
      key_ok: (..., Nk) bool, True for the keys to attend to; every row needs at least one.
      scale: logit scale.
      implementation: fused attention implementation (:func:`jaxrat.ops.gpu.fused.choose_implementation`).

    Returns:
      (..., Nq, dv) in q's dtype.
    """
    # Axes of size 1 stay so: one order for every head (DETR's mask is per image), sorted once.
    key_ok = jnp.broadcast_to(key_ok, (*key_ok.shape[:-1], k.shape[-2]))
    lengths, (k, v) = pack(key_ok, (k, v))
    lengths = jnp.broadcast_to(lengths, k.shape[:-2])
    return fused_attention(q, k, v, scale=scale, kv_lengths=lengths, implementation=implementation)


def pack(key_ok: Array, arrays) -> tuple[Array, tuple[Array, ...]]:
    """Each row's kept tokens gathered to its front, in order, in every (..., N, D) array of ``arrays``
    (``key_ok`` (..., N) bool, its axes of size 1 broadcasting; one stable order for all,
    differentiated by the inverse order), and the rows' counts (...) int32: attention over them, or
    over keys and values made token by token from them, is then masked by length."""
    order = jnp.argsort(~key_ok, axis=-1, stable=True)[..., None]
    inverse = inverse_order(order)
    lengths = jnp.sum(key_ok, axis=-1, dtype=jnp.int32)
    return lengths, tuple(permute_keys(a, order, inverse) for a in arrays)
