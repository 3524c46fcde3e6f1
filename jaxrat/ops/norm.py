"""Layer normalisation over the last axis, with a backward that reuses the forward's statistics.

The gpu policy's form (:func:`layer_norm`) keeps each token's mean and 1/std (float32) for the
backward. Flax's LayerNorm differentiated by JAX recomputes them there, inside the kernel that forms
the float32 product x_hat * g of the whole activation; a reduction (the statistics) inside another
(the scale's gradient, summed over tokens) does not fuse, so that product went through memory first.
Compiled for an H100 the ISIC step ran 27 fewer kernels with this form (benchmarks/gpu_cost.py).
Other policies keep flax's own (the same function, up to rounding).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

Array = jax.Array


def layer_norm(x: Array, scale: Array, bias: Array, eps: float, dtype) -> Array:
    """``(x - mean) / sqrt(var + eps) * scale + bias`` over the last axis (statistics and arithmetic in
    float32), in ``dtype``; differentiable in x, scale and bias."""
    return _norm(x, scale.astype(jnp.float32), bias.astype(jnp.float32), float(eps), jnp.dtype(dtype))


def _forward(x, scale, bias, eps, dtype):
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, -1, keepdims=True)
    centred = xf - mean
    rstd = jax.lax.rsqrt(jnp.mean(centred * centred, -1, keepdims=True) + eps)
    return (centred * rstd * scale + bias).astype(dtype), (x, mean, rstd, scale)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _norm(x, scale, bias, eps, dtype):
    return _forward(x, scale, bias, eps, dtype)[0]


def _norm_bwd(eps, dtype, res, g):
    x, mean, rstd, scale = res
    g = g.astype(jnp.float32)
    x_hat = (x.astype(jnp.float32) - mean) * rstd
    tokens = tuple(range(x.ndim - 1))
    gs = g * scale
    dx = rstd * (gs - jnp.mean(gs, -1, keepdims=True) - x_hat * jnp.mean(gs * x_hat, -1, keepdims=True))
    sums = jnp.sum(jnp.stack([g * x_hat, g]), tuple(t + 1 for t in tokens))
    return dx.astype(x.dtype), sums[0], sums[1]


_norm.defvjp(_forward, _norm_bwd)
