"""Stride-1 convolution whose weight gradient runs over row strips: a drop-in for large inputs on CPU.

XLA's CPU weight gradient of a stride-1 convolution slows down sharply once the output gradient no
longer fits in cache. Here the forward pass and the input gradient stay XLA's, and the weight
gradient is a sum over strips of rows of one matmul each, so each strip's working set stays
cache-sized; taken from :data:`MIN_STRIP_BYTES` of output gradient, on the ``cpu`` policy only
(docs/history/cpu.md, "CPU kernels").
"""

from __future__ import annotations

import itertools
import math
from typing import Sequence

import jax
import jax.numpy as jnp

Array = jax.Array

# Output-gradient bytes from which the strip form is taken (XLA's own is faster below).
MIN_STRIP_BYTES = 32 << 20
# Output-gradient bytes per strip: cache-sized.
STRIP_BYTES = 4 << 20


def channels_last(ndim: int) -> jax.lax.ConvDimensionNumbers:
    """(N, *spatial, C) inputs and outputs, (*kernel, Cin, Cout) kernels."""
    return jax.lax.ConvDimensionNumbers(
        lhs_spec=(0, ndim - 1, *range(1, ndim - 1)),
        rhs_spec=(ndim - 1, ndim - 2, *range(0, ndim - 2)),
        out_spec=(0, ndim - 1, *range(1, ndim - 1)),
    )


def _xla_conv(x: Array, w: Array) -> Array:
    pads = [((k - 1) // 2, (k - 1) // 2) for k in w.shape[:-2]]
    return jax.lax.conv_general_dilated(x, w, (1,) * (x.ndim - 2), pads,
                                        dimension_numbers=channels_last(x.ndim))


def strip_rows(dy_shape: Sequence[int]) -> int:
    """Rows (first spatial axis) per strip: about :data:`STRIP_BYTES` of float32 output gradient."""
    row_bytes = 4 * math.prod(dy_shape) // dy_shape[1]
    return max(1, min(int(dy_shape[1]), STRIP_BYTES // max(row_bytes, 1)))


def use_strips(x: Array, w: Array) -> bool:
    """Whether the strip form applies and pays off: odd kernels (the output keeps the input's
    grid) and an output gradient of :data:`MIN_STRIP_BYTES` or more."""
    out_bytes = 4 * math.prod(x.shape[:-1]) * int(w.shape[-1])
    odd = all(int(k) % 2 for k in w.shape[:-2])
    return odd and out_bytes >= MIN_STRIP_BYTES


def strip_conv(x: Array, w: Array) -> Array:
    """Channels-last stride-1 convolution, odd kernel, padding ``(k-1)//2`` on both sides of every axis.

    x (N, *spatial, Cin), w (*kernel, Cin, Cout) -> (N, *spatial, Cout), equal to
    ``lax.conv_general_dilated`` (it is that, forward); the weight gradient is computed strip by
    strip of the first spatial axis (module docstring), the input gradient by XLA.
    """
    return _strip_conv(x, w)


@jax.custom_vjp
def _strip_conv(x: Array, w: Array) -> Array:
    return _xla_conv(x, w)


def _strip_conv_fwd(x, w):
    return _xla_conv(x, w), (x, w)


def _patches(xp: Array, out_spatial: Sequence[int], kernel: Sequence[int]) -> Array:
    """(N, *out + k - 1, Cin) padded input -> (N, *out, prod(kernel) * Cin), taps in w's order."""
    taps = [xp[(slice(None),) + tuple(slice(o, o + n) for o, n in zip(offset, out_spatial))]
            for offset in itertools.product(*(range(k) for k in kernel))]
    return jnp.concatenate(taps, axis=-1)


def strip_weight_gradient(x: Array, dy: Array, kernel: Sequence[int], rows: int) -> Array:
    """dW (*kernel, Cin, Cout) of :func:`strip_conv` for output gradient ``dy``, ``rows`` rows at a time."""
    kernel = tuple(int(k) for k in kernel)
    cin, cout, h = x.shape[-1], dy.shape[-1], x.shape[1]
    xp = jnp.pad(x, [(0, 0)] + [((k - 1) // 2, (k - 1) // 2) for k in kernel] + [(0, 0)])
    rest = tuple(x.shape[2:-1])

    def strip(start: Array | int, n: int) -> Array:
        xs = jax.lax.dynamic_slice_in_dim(xp, start, n + kernel[0] - 1, axis=1)
        ds = jax.lax.dynamic_slice_in_dim(dy, start, n, axis=1)
        p = _patches(xs, (n, *rest), kernel)
        return jnp.einsum("n...p,n...o->po", p, ds, preferred_element_type=jnp.float32)

    full, tail = divmod(h, rows)
    dw = jnp.zeros((math.prod(kernel) * cin, cout), jnp.float32)
    if full:
        dw = jax.lax.fori_loop(0, full, lambda i, acc: acc + strip(i * rows, rows), dw)
    if tail:
        dw = dw + strip(full * rows, tail)
    return dw.reshape(*kernel, cin, cout)


def _strip_conv_bwd(res, dy):
    x, w = res
    _, input_t = jax.vjp(lambda xx: _xla_conv(xx, w), x)
    dw = strip_weight_gradient(x, dy, w.shape[:-2], strip_rows(dy.shape))
    return input_t(dy)[0], dw.astype(w.dtype)


_strip_conv.defvjp(_strip_conv_fwd, _strip_conv_bwd)
