"""The RoSE rotation with a hand-written backward for CPUs (the ``cpu`` kernel policy).

XLA:CPU reads the operands of a reduction over a short leading (batch) axis slowly, so the angle
gradient adds the images one by one instead (measurements: docs/history/cpu.md, "CPU kernels").
The forward is the portable one (:func:`jaxrat.ops.portable.rotate.turn_heads`).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from jaxrat.ops.portable.rotate import turn, turn_heads

Array = jax.Array
# Largest leading (batch) axis whose sum the backward writes out as adds.
UNROLLED_BATCH_SUM = 16


def _batch_sum(x: Array, dtype: Any) -> Array:
    """Sum over axis 0 in float32, a few images added one by one (module docstring)."""
    if x.shape[0] > UNROLLED_BATCH_SUM:
        return jnp.sum(x, axis=0, dtype=jnp.float32).astype(dtype)
    total = x[0].astype(jnp.float32)
    for i in range(1, x.shape[0]):
        total = total + x[i].astype(jnp.float32)
    return total.astype(dtype)


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def rotate_heads(x: Array, cos: Array, sin: Array, heads: int) -> Array:
    """:func:`jaxrat.ops.portable.rotate.turn_heads` with the CPU backward (module docstring)."""
    return turn_heads(x, cos, sin, heads)


def _rotate_fwd(x, cos, sin, heads):
    return turn_heads(x, cos, sin, heads), (x[:, :, :heads], cos, sin)


def _rotate_bwd(heads, res, g):
    xr, cos, sin = res
    b, n, _, dh = xr.shape
    h = g.shape[2]
    pairs = xr.reshape(b, n, heads, dh // 2, 2)
    re, im = pairs[..., 0], pairs[..., 1]
    gp = g[:, :, :heads].reshape(b, n, heads, dh // 2, 2)
    g_re, g_im = gp[..., 0], gp[..., 1]
    dx = turn(g_re, g_im, cos, -sin).reshape(b, n, heads, dh)  # the inverse rotation
    if heads != h:
        dx = jnp.concatenate([dx, g[:, :, heads:]], axis=2)
    d_cos = _batch_sum(g_re * re + g_im * im, cos.dtype)
    d_sin = _batch_sum(g_im * re - g_re * im, sin.dtype)
    return dx, d_cos, d_sin


rotate_heads.defvjp(_rotate_fwd, _rotate_bwd)
