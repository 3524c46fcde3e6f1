"""The rotation of rotary embeddings (RoSE), in the form the kernel policy picks."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrat.ops.policy import PORTABLE, KernelPolicy

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


def rotate_heads(x: Array, cos: Array, sin: Array, heads: int, policy: KernelPolicy = PORTABLE) -> Array:
    """:func:`turn_heads`, differentiated by autodiff, or on the cpu policy by the CPU's backward
    (:mod:`jaxrat.ops.cpu.rotate`)."""
    if policy.cpu:
        from jaxrat.ops.cpu import SCOPE
        from jaxrat.ops.cpu.rotate import rotate_heads as cpu_rotate

        with jax.named_scope(SCOPE):
            return cpu_rotate(x, cos, sin, heads)
    return turn_heads(x, cos, sin, heads)
