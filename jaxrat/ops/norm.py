"""Layer normalisation over the last axis (:func:`normalise`: the policy's form, else flax's), with a
backward that reuses the forward's statistics.

The gpu policy's form (:func:`layer_norm`): Pallas kernels in bfloat16 (:mod:`jaxrat.ops.gpu.layer_norm`);
otherwise XLA's, which keeps each token's mean and 1/std (float32) for the
backward. Flax's LayerNorm differentiated by JAX recomputes them there, inside the kernel that forms
the float32 product x_hat * g of the whole activation; a reduction (the statistics) inside another
(the scale's gradient, summed over tokens) does not fuse, so that product went through memory first.
Compiled for an H100 the ISIC step runs fewer kernels with this form (benchmarks/gpu_cost.py).
Other policies keep flax's own (the same function, up to rounding).
"""

from __future__ import annotations

import importlib
from functools import partial
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxrat.ops import per_device
from jaxrat.ops.policy import KernelPolicy

Array = jax.Array


def _gpu_layer_norm():
    """:mod:`jaxrat.ops.gpu.layer_norm`, imported when a gpu policy first asks for it: it loads Pallas's
    Triton backend, a cost at every start that a run on other devices never needs."""
    return importlib.import_module("jaxrat.ops.gpu.layer_norm")


def normalise(x: Array, scale: Any, bias: Any, eps: float, dtype, policy: Optional[KernelPolicy], *,
              mask: Optional[Array] = None, residual: Optional[Array] = None,
              flax_form: Callable[..., Array]) -> Array:
    """``(residual +) layer_norm(x)`` with ``scale`` and ``bias`` (arrays or flax variables; None: not
    used): :func:`layer_norm` where the policy uses that form, unmasked, with both; else ``flax_form``,
    the flax module's own ``(x, mask=mask)``, the residual added after."""
    if policy is None or not policy.uses("layer_norm") or mask is not None or scale is None or bias is None:
        y = flax_form(x, mask=mask)
        return y if residual is None else residual + y
    return layer_norm(x, scale[...], bias[...], eps, dtype, residual)


def layer_norm(x: Array, scale: Array, bias: Array, eps: float, dtype, residual: Array | None = None) -> Array:
    """``(residual +) (x - mean) / sqrt(var + eps) * scale + bias`` over the last axis (statistics and
    arithmetic in float32), in ``dtype``; differentiable in x, scale, bias and the residual.

    bfloat16 in and out runs the Pallas kernels of :mod:`jaxrat.ops.gpu.layer_norm` (per device under
    a mesh), the residual added there before the one rounding; other dtypes (a float32 parity run)
    the XLA form below, the residual added after."""
    kernels = _gpu_layer_norm()
    dtype = jnp.dtype(dtype)
    fits = residual is None or (residual.shape == x.shape and residual.dtype == dtype)
    if (fits and x.dtype == dtype == jnp.bfloat16 and x.ndim >= 2
            and kernels.supports(int(np.prod(x.shape[:-1])), x.shape[-1], x.dtype) is None):
        weights = (scale, bias)
        if residual is None:
            return per_device.over_batch(lambda x, s, b: kernels.layer_norm(x, s, b, eps), x, replicated=weights)
        return per_device.over_batch(lambda x, r, s, b: kernels.layer_norm(x, s, b, eps, r), x, residual,
                                     replicated=weights)
    y = _norm(x, scale.astype(jnp.float32), bias.astype(jnp.float32), float(eps), dtype)
    return y if residual is None else residual + y


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
