"""Strided convolution as stride-block matmuls: a drop-in for ``lax.conv_general_dilated``.

The SGA layer's strider (a 7x7 convolution with stride 3 on the full-resolution tokens) was half
of the whole RAT step at 512 px on CPU, and its cost grew ~6x per doubling of the side instead
of 4x: XLA's CPU weight gradient of a strided convolution took 15 s of the 18 s fwd+bwd at
512 px, batch 2 (benchmarks/rat_scaling.py, docs/rat.md). Cut the padded input into stride-blocks
(each output's window is ``ceil(k/s)`` whole blocks per axis, the kernel zero-padded to match);
the convolution is then one plain matmul of the blocks with every block offset's kernel slice,
whose gradients are plain matmuls too: about half the time at 512 px, linear in pixels. Below ~256x256 inputs XLA's own convolution is
faster on CPU (0.31 vs 0.52 s at 128 px), and on accelerators the vendor convolution is left alone,
so :func:`conv_general_dilated` only takes the blocked form for large inputs on CPU.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrat.models.sparse_sga import Geometry, _blocked, _take_at_offset

Array = jax.Array
# Input positions per image from which the blocked form wins on CPU (measured crossover: equal
# at 256x256, 2x faster at 512x512, 1.6x slower at 128x128).
MIN_BLOCKED_POSITIONS = 256 * 256


def _kernel_matrix(w: Array, geom: Geometry) -> Array:
    """(*k, Cin, Cout) -> (s.. * Cin, offsets * Cout): the kernel zero-padded to whole blocks."""
    sd, cin, cout = len(geom.kernel), w.shape[-2], w.shape[-1]
    nb = [-(-k // s) for k, s in zip(geom.kernel, geom.stride)]
    wp = jnp.pad(w, [(0, b * s - k) for b, s, k in zip(nb, geom.stride, geom.kernel)] + [(0, 0), (0, 0)])
    # (nb_1, s_1, ..., nb_sd, s_sd, Cin, Cout) -> (s.., Cin, nb.., Cout)
    wp = wp.reshape(*[d for b, s in zip(nb, geom.stride) for d in (b, s)], cin, cout)
    perm = [2 * d + 1 for d in range(sd)] + [2 * sd] + [2 * d for d in range(sd)] + [2 * sd + 1]
    return wp.transpose(perm).reshape(int(np.prod(geom.stride)) * cin, len(geom.offsets) * cout)


def _block_rows(x: Array, geom: Geometry) -> Array:
    """(N, *spatial, Cin) -> (N, B.., s.. * Cin): each stride-block's pixels as one row."""
    return _blocked(x, geom.kernel, geom.stride).reshape(x.shape[0], *geom.blocks, -1)


def _sum_offsets(yb: Array, geom: Geometry) -> Array:
    """(N, B.., offsets * Cout) -> (N, o.., Cout): each output adds its window's block shares."""
    yb = yb.reshape(*yb.shape[:-1], len(geom.offsets), -1)
    out = None
    for i, j in enumerate(geom.offsets):
        part = _take_at_offset(yb[..., i, :], j, geom)
        out = part if out is None else out + part
    return out


def blocked_strided_conv(x: Array, w: Array, stride: Sequence[int]) -> Array:
    """Channels-last convolution with padding ``(k-1)//2`` on both sides, as block matmuls.

    x (N, *spatial, Cin), w (*kernel, Cin, Cout) -> (N, *out, Cout), ``out`` as
    :func:`jaxrat.models.sparse_sga.strided_grid`. Equal to ``lax.conv_general_dilated`` with
    that padding up to float rounding (summation order).

    One matmul gives every block's contribution to each window that reads it; each output then
    adds its offsets' shares. The custom VJP keeps only ``x`` and ``w`` and re-cuts the (cheap)
    blocks in the backward pass: autodiff kept the blocked copy of the full-resolution input.
    """
    return _blocked_conv(x, w, Geometry(tuple(x.shape[1:-1]), tuple(w.shape[:-2]), tuple(int(s) for s in stride)))


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _blocked_conv(x: Array, w: Array, geom: Geometry) -> Array:
    return _sum_offsets(_block_rows(x, geom) @ _kernel_matrix(w, geom), geom)


def _blocked_conv_fwd(x, w, geom):
    return _blocked_conv(x, w, geom), (x, w)


def _blocked_conv_bwd(geom, res, dy):
    x, w = res
    # d(block rows) of the window sums: each offset's cotangent shifted back onto the blocks
    _, transpose = jax.vjp(lambda yb: _sum_offsets(yb, geom),
                           jnp.zeros((x.shape[0], *geom.blocks, len(geom.offsets) * w.shape[-1]), dy.dtype))
    dyb = transpose(dy)[0]
    # Depend on dy so that XLA does not hoist (or CSE) the re-cut blocks into the forward pass.
    xr = _block_rows(x + (0 * jnp.sum(dy[(0,) * dy.ndim])).astype(x.dtype), geom)
    wm = _kernel_matrix(w, geom)
    _, conv_t = jax.vjp(lambda xx: _block_rows(xx, geom), x)
    dx = conv_t(dyb @ wm.T.astype(dyb.dtype))[0]
    _, wt = jax.vjp(lambda ww: _kernel_matrix(ww, geom), w)
    dw = wt(jnp.einsum("...i,...j->ij", xr, dyb))[0]
    return dx.astype(x.dtype), dw.astype(w.dtype)


_blocked_conv.defvjp(_blocked_conv_fwd, _blocked_conv_bwd)


def _channels_last(ndim: int) -> jax.lax.ConvDimensionNumbers:
    return jax.lax.ConvDimensionNumbers(
        lhs_spec=(0, ndim - 1, *range(1, ndim - 1)),
        rhs_spec=(ndim - 1, ndim - 2, *range(0, ndim - 2)),
        out_spec=(0, ndim - 1, *range(1, ndim - 1)),
    )


def conv_general_dilated(lhs: Array, rhs: Array, window_strides: Sequence[int], padding: Any,
                         lhs_dilation: Any = None, rhs_dilation: Any = None, dimension_numbers: Any = None,
                         feature_group_count: int = 1, precision: Any = None,
                         preferred_element_type: Any = None, **kwargs: Any) -> Array:
    """``lax.conv_general_dilated``, taking :func:`blocked_strided_conv` where it is faster.

    That is: on CPU, channels-last, undilated, ungrouped, stride > 1 on some axis, symmetric
    ``(k-1)//2`` padding, and at least :data:`MIN_BLOCKED_POSITIONS` input positions per image.
    """
    kernel = tuple(rhs.shape[:-2])
    use_blocked = (
        jax.default_backend() == "cpu"
        and any(int(s) > 1 for s in window_strides)
        and not isinstance(padding, str)
        and [tuple(p) for p in padding] == [((k - 1) // 2, (k - 1) // 2) for k in kernel]
        and all(d in (None, 1) for d in (lhs_dilation or (None,)))
        and all(d in (None, 1) for d in (rhs_dilation or (None,)))
        and feature_group_count == 1
        and dimension_numbers == _channels_last(lhs.ndim)
        and int(np.prod(lhs.shape[1:-1])) >= MIN_BLOCKED_POSITIONS
        and not kwargs.get("out_sharding")
    )
    if use_blocked:
        return blocked_strided_conv(lhs, rhs, window_strides)
    return jax.lax.conv_general_dilated(
        lhs, rhs, window_strides, padding, lhs_dilation=lhs_dilation, rhs_dilation=rhs_dilation,
        dimension_numbers=dimension_numbers, feature_group_count=feature_group_count, precision=precision,
        preferred_element_type=preferred_element_type, **kwargs)
