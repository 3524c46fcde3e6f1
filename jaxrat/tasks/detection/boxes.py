"""Box conversions, IoU and generalised IoU for normalised float32 boxes.

Boxes are ``(cx, cy, w, h)`` (what the detection head predicts) or ``(x0, y0, x1, y1)`` (what IoU
needs), in image-normalised coordinates. Every ratio here is guarded so that zero-area boxes (padded
targets are all zeros) give finite values *and* finite gradients: a plain ``inter / union`` with
``union == 0`` is NaN, and ``jnp.where`` alone does not stop the NaN reaching the gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def cxcywh_to_xyxy(boxes: jax.Array) -> jax.Array:
    """``(..., 4)`` ``(cx, cy, w, h)`` -> ``(x0, y0, x1, y1)``."""
    cx, cy, w, h = jnp.moveaxis(boxes, -1, 0)
    return jnp.stack([cx - 0.5 * w, cy - 0.5 * h, cx + 0.5 * w, cy + 0.5 * h], axis=-1)


def xyxy_to_cxcywh(boxes: jax.Array) -> jax.Array:
    """``(..., 4)`` ``(x0, y0, x1, y1)`` -> ``(cx, cy, w, h)``."""
    x0, y0, x1, y1 = jnp.moveaxis(boxes, -1, 0)
    return jnp.stack([0.5 * (x0 + x1), 0.5 * (y0 + y1), x1 - x0, y1 - y0], axis=-1)


def box_area(boxes: jax.Array) -> jax.Array:
    """Area of ``(..., 4)`` xyxy boxes; inverted boxes count as empty rather than negative."""
    return jnp.maximum(boxes[..., 2] - boxes[..., 0], 0.0) * jnp.maximum(boxes[..., 3] - boxes[..., 1], 0.0)


def _safe_div(num: jax.Array, den: jax.Array) -> jax.Array:
    # Double where: the inner one keeps the untaken branch's gradient finite, the outer one defines 0/0 = 0.
    ok = den > 0
    return jnp.where(ok, num / jnp.where(ok, den, 1.0), 0.0)


def _iou_parts(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(iou, union, enclosing area) of xyxy boxes ``a`` and ``b`` broadcast against each other."""
    iw = jnp.maximum(jnp.minimum(a[..., 2], b[..., 2]) - jnp.maximum(a[..., 0], b[..., 0]), 0.0)
    ih = jnp.maximum(jnp.minimum(a[..., 3], b[..., 3]) - jnp.maximum(a[..., 1], b[..., 1]), 0.0)
    inter = iw * ih
    union = box_area(a) + box_area(b) - inter
    ew = jnp.maximum(jnp.maximum(a[..., 2], b[..., 2]) - jnp.minimum(a[..., 0], b[..., 0]), 0.0)
    eh = jnp.maximum(jnp.maximum(a[..., 3], b[..., 3]) - jnp.minimum(a[..., 1], b[..., 1]), 0.0)
    return _safe_div(inter, union), union, ew * eh


def elementwise_iou(a: jax.Array, b: jax.Array) -> jax.Array:
    """IoU of xyxy boxes ``a[..., 4]`` and ``b[..., 4]`` (broadcast); 0 when both are empty."""
    return _iou_parts(a, b)[0]


def elementwise_giou(a: jax.Array, b: jax.Array) -> jax.Array:
    """Generalised IoU (Rezatofighi et al. 2019) in [-1, 1] of xyxy boxes ``a`` and ``b`` (broadcast).

    ``iou - (enclosing - union) / enclosing``; two empty boxes at the same point give 0.
    """
    iou, union, enclosing = _iou_parts(a, b)
    return iou - _safe_div(enclosing - union, enclosing)


def pairwise_iou(a: jax.Array, b: jax.Array) -> jax.Array:
    """``(..., N, 4)`` x ``(..., M, 4)`` xyxy -> ``(..., N, M)`` IoU."""
    return elementwise_iou(a[..., :, None, :], b[..., None, :, :])


def pairwise_giou(a: jax.Array, b: jax.Array) -> jax.Array:
    """``(..., N, 4)`` x ``(..., M, 4)`` xyxy -> ``(..., N, M)`` generalised IoU."""
    return elementwise_giou(a[..., :, None, :], b[..., None, :, :])
