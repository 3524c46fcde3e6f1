"""The RoSE rotation as one elementwise expression, for GPUs.

:func:`jaxrat.ops.portable.rotate.turn_heads` builds its result with concatenates (the (re, im)
pairs stacked, the unrotated heads appended). XLA:GPU roots a fusion at a concatenate and fuses
no consumer into it, so whatever follows the rotation (the sparse SGA's key scale on the queries,
the casts) was its own kernel, a read and a write of the whole activation. Here every head and
feature turns by a table over all of them (the unrotated heads by angle 0: cos 1, sin 0):

    y = x * c + flip_pairs(x) * s,    c = (cos, cos),  s = (-sin, sin) per pair

the same products and sums as the complex form (a - b is a + (-b) exactly), so the same values in
any dtype. The op takes the angles, not their cosines and sines, so that the backward gives the
angles' gradient as one sum over the batch, over the rotated heads and pairs only:

    d_phase = sum_b (g_im re - g_re im) cos(phase) - (g_re re + g_im im) sin(phase)

in float32 (as gradients of the cosine and sine tables, XLA read the activation and its gradient
twice, once for each table: twice the bytes, compiled for an H100).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

Array = jax.Array


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def turn_heads(x: Array, phase: Array, heads: int) -> Array:
    """Rotate the first ``heads`` heads of ``x`` (B, N, H, dh), features as interleaved (re, im)
    pairs, by the angles ``phase`` (N, heads, dh/2), broadcast over B (their cosines and sines
    rounded to x's dtype); the other heads pass."""
    return turn(x, *tables(phase, x.dtype), heads)


def tables(phase: Array, dtype) -> tuple[Array, Array]:
    """cos and sin of the angles, rounded to ``dtype`` (the tables the forward turns by)."""
    return jnp.cos(phase).astype(dtype), jnp.sin(phase).astype(dtype)


def _turn_fwd(x, phase, heads):
    return turn_heads(x, phase, heads), (x, phase)


def _turn_bwd(heads, res, g):
    x, phase = res
    b, n, _, dh = x.shape
    pairs = lambda a: a[:, :, :heads].reshape(b, n, heads, dh // 2, 2).astype(jnp.float32)
    xp, gp = pairs(x), pairs(g)
    re, im, g_re, g_im = xp[..., 0], xp[..., 1], gp[..., 0], gp[..., 1]
    phase = phase.astype(jnp.float32)
    d_phase = jnp.sum((g_im * re - g_re * im) * jnp.cos(phase) - (g_re * re + g_im * im) * jnp.sin(phase), 0)
    cos, sin = tables(phase, x.dtype)
    return turn(g, cos, -sin, heads).astype(x.dtype), d_phase.astype(res[1].dtype)


turn_heads.defvjp(_turn_fwd, _turn_bwd)


def turn(x: Array, cos: Array, sin: Array, heads: int) -> Array:
    """The first ``heads`` heads of x turned by the tables (cos, sin) (N, heads, dh/2), no autodiff rule."""
    b, n, h, dh = x.shape
    c = jnp.repeat(cos, 2, axis=-1)
    s = (jnp.stack([-sin, sin], -1)).reshape(n, heads, dh)
    if heads != h:  # the tables are small: padding them costs nothing beside the activation
        c = jnp.pad(c, ((0, 0), (0, h - heads), (0, 0)), constant_values=1)
        s = jnp.pad(s, ((0, 0), (0, h - heads), (0, 0)))
    flipped = x.reshape(b, n, h, dh // 2, 2)[..., ::-1].reshape(b, n, h, dh)
    return x * c.astype(x.dtype) + flipped * s.astype(x.dtype)
