"""Strided convolution as stride-block matmuls: a drop-in for ``lax.conv_general_dilated`` on CPU.

XLA's CPU weight gradient of a strided convolution (the SGA layer's strider) grows faster than the
pixels. Cut the padded input into stride-blocks (each output's window is ``ceil(k/s)`` whole blocks
per axis); every block offset's share of the windows that read it is a plain matmul of the blocks
with that offset's kernel slice (offsets covering equally many taps share one matmul), and each
output adds its offsets' shares; the gradients are plain matmuls too. Only the ``cpu`` kernel
policy takes it (docs/history/cpu.md, "CPU kernels"); accelerators keep the vendor's convolution.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrat.ops.cpu import SCOPE, strip_conv
from jaxrat.ops.portable.sparse_sga import Geometry, _blocked, _take_at_offset

Array = jax.Array
# Input positions per image from which the blocked form is taken on CPU (smaller ones do not matter).
MIN_BLOCKED_POSITIONS = 32 * 32


def _tap_groups(geom: Geometry) -> dict[tuple[int, ...], list[tuple[int, ...]]]:
    """Block offsets grouped by how many kernel taps per axis they cover.

    Offset j covers taps ``j*s .. j*s + sz`` with ``sz = min(s, k - j*s)``: a 7-tap kernel with
    stride 3 covers 3, 3 and 1 taps per axis. Offsets with equal ``sz`` read the same leading
    ``sz`` pixels of each block, so one matmul serves them all, and no zero taps are multiplied
    (49 taps for 7x7 stride 3, not the 81 of zero-padding the kernel to whole blocks).
    """
    groups: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
    for j in geom.offsets:
        sz = tuple(min(s, k - jd * s) for jd, k, s in zip(j, geom.kernel, geom.stride))
        groups.setdefault(sz, []).append(j)
    return groups


def _group_products(xb: Array, w: Array, geom: Geometry) -> dict[tuple[int, ...], Array]:
    """Blocks (N, B.., s.., Cin) times each offset's kernel slice -> offset: (N, B.., Cout)."""
    sd, n, cin, cout = len(geom.kernel), xb.shape[0], w.shape[-2], w.shape[-1]
    out = {}
    for sz, offsets in _tap_groups(geom).items():
        rows = xb[(Ellipsis,) + tuple(slice(0, z) for z in sz) + (slice(None),)]
        rows = rows.reshape(n, *geom.blocks, int(np.prod(sz)) * cin)
        mats = [w[tuple(slice(jd * s, jd * s + z) for jd, s, z in zip(j, geom.stride, sz))].reshape(-1, cout)
                for j in offsets]
        y = (rows @ jnp.concatenate(mats, axis=1).astype(rows.dtype)).reshape(n, *geom.blocks, len(offsets), cout)
        for i, j in enumerate(offsets):
            out[j] = y[..., i, :]
    assert len(out) == len(geom.offsets) and sd == len(geom.stride)
    return out


def _sum_offsets(parts: dict[tuple[int, ...], Array], geom: Geometry) -> Array:
    """Offset: (N, B.., Cout) -> (N, o.., Cout): each output adds its window's block shares."""
    out = None
    for j in geom.offsets:
        part = _take_at_offset(parts[j], j, geom)
        out = part if out is None else out + part
    return out


def blocked_strided_conv(x: Array, w: Array, stride: Sequence[int]) -> Array:
    """Channels-last convolution with padding ``(k-1)//2`` on both sides, as block matmuls.

    x (N, *spatial, Cin), w (*kernel, Cin, Cout) -> (N, *out, Cout), ``out`` as
    :func:`jaxrat.ops.portable.sparse_sga.strided_grid`. Equal to ``lax.conv_general_dilated`` with
    that padding up to float rounding (summation order).

    One matmul gives every block's contribution to each window that reads it; each output then
    adds its offsets' shares. The custom VJP keeps only ``x`` and ``w`` and re-cuts the (cheap)
    blocks in the backward pass: autodiff kept the blocked copy of the full-resolution input.
    """
    return _blocked_conv(x, w, Geometry(tuple(x.shape[1:-1]), tuple(w.shape[:-2]), tuple(int(s) for s in stride)))


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _blocked_conv(x: Array, w: Array, geom: Geometry) -> Array:
    return _sum_offsets(_group_products(_blocked(x, geom.kernel, geom.stride), w, geom), geom)


def _blocked_conv_fwd(x, w, geom):
    return _blocked_conv(x, w, geom), (x, w)


def _blocked_conv_bwd(geom, res, dy):
    x, w = res
    # Depend on dy so that XLA does not hoist (or CSE) the re-cut blocks into the forward pass.
    xd = x + (0 * jnp.sum(dy[(0,) * dy.ndim])).astype(x.dtype)
    xb, block_t = jax.vjp(lambda xx: _blocked(xx, geom.kernel, geom.stride), xd)
    _, products_t = jax.vjp(lambda xx, ww: _sum_offsets(_group_products(xx, ww, geom), geom), xb, w)
    dxb, dw = products_t(dy)
    return block_t(dxb)[0].astype(x.dtype), dw.astype(w.dtype)


_blocked_conv.defvjp(_blocked_conv_fwd, _blocked_conv_bwd)


def conv_general_dilated(lhs: Array, rhs: Array, window_strides: Sequence[int], padding: Any,
                         lhs_dilation: Any = None, rhs_dilation: Any = None, dimension_numbers: Any = None,
                         feature_group_count: int = 1, precision: Any = None,
                         preferred_element_type: Any = None, **kwargs: Any) -> Array:
    """``lax.conv_general_dilated``, taking a CPU-friendlier form where one was measured faster.

    Both need: channels-last, undilated, ungrouped, padding ``(k-1)//2`` on both sides (or
    "SAME" at stride 1 with odd kernels), no precision or output-type request. Then a strided
    convolution on at least :data:`MIN_BLOCKED_POSITIONS` input positions per image is
    :func:`blocked_strided_conv`, and a stride-1 one with a large output is
    :func:`jaxrat.ops.cpu.strip_conv.strip_conv` (XLA's forward, weight gradient over row strips).
    """
    kernel = tuple(rhs.shape[:-2])
    stride_one = all(int(s) == 1 for s in window_strides)
    symmetric = [((k - 1) // 2, (k - 1) // 2) for k in kernel]
    if isinstance(padding, str):
        same_pads = padding.upper() == "SAME" and stride_one and all(k % 2 for k in kernel)
    else:
        same_pads = [tuple(p) for p in padding] == symmetric
    eligible = (
        same_pads
        and all(d in (None, 1) for d in (lhs_dilation or (None,)))
        and all(d in (None, 1) for d in (rhs_dilation or (None,)))
        and feature_group_count == 1
        and dimension_numbers == strip_conv.channels_last(lhs.ndim)
        and precision is None
        and preferred_element_type is None
        and not kwargs.get("out_sharding")
    )
    if eligible and not stride_one and int(np.prod(lhs.shape[1:-1])) >= MIN_BLOCKED_POSITIONS:
        with jax.named_scope(SCOPE):
            return blocked_strided_conv(lhs, rhs, window_strides)
    if eligible and stride_one and strip_conv.use_strips(lhs, rhs):
        with jax.named_scope(SCOPE):
            return strip_conv.strip_conv(lhs, rhs)
    return jax.lax.conv_general_dilated(
        lhs, rhs, window_strides, padding, lhs_dilation=lhs_dilation, rhs_dilation=rhs_dilation,
        dimension_numbers=dimension_numbers, feature_group_count=feature_group_count, precision=precision,
        preferred_element_type=preferred_element_type, **kwargs)
