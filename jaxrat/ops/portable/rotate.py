"""The RoSE rotation as plain complex products on interleaved (re, im) feature pairs."""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def turn(re: Array, im: Array, cos: Array, sin: Array) -> Array:
    """(re + i im) * (cos + i sin), as interleaved (re, im) pairs on a new last axis."""
    return jnp.stack([re * cos - im * sin, re * sin + im * cos], -1)


def turn_heads(x: Array, cos: Array, sin: Array, heads: int) -> Array:
    """Rotate the first ``heads`` heads of ``x`` (B, N, H, dh), features as interleaved (re, im)
    pairs, by (cos + i sin) of shape (N, heads, dh/2), broadcast over B; the other heads pass."""
    b, n, h, dh = x.shape
    pairs = x[:, :, :heads].reshape(b, n, heads, dh // 2, 2)
    rot = turn(pairs[..., 0], pairs[..., 1], cos, sin).reshape(b, n, heads, dh)
    return rot if heads == h else jnp.concatenate([rot, x[:, :, heads:]], axis=2)
