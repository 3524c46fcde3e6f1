"""Binary segmentation: BCE + soft Dice loss, and eval metrics over a whole eval set.

Eval metrics are computed from sums, so they are exact whatever the batch split: each eval step
returns per-batch sums (inside jit, so they are reduced across all devices and hosts) and
:func:`finalize_metrics` turns the accumulated sums into Dice, IoU, sensitivity, specificity and
accuracy. Per-image Dice/IoU are averaged over images; an image whose mask and prediction are both
empty scores 1, never NaN.
"""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax

_EPS = 1e-6


def loss_fn(logits: jax.Array, mask: jax.Array, *, bce_weight: float, dice_weight: float) -> tuple[jax.Array, dict]:
    """``bce_weight * BCE + dice_weight * (1 - mean per-image soft Dice)``; returns (loss, parts)."""
    logits = logits.astype(jnp.float32)
    bce = optax.sigmoid_binary_cross_entropy(logits, mask).mean()
    p = jax.nn.sigmoid(logits)
    axes = tuple(range(1, p.ndim))
    inter = (p * mask).sum(axes)
    dice = (2 * inter + _EPS) / (p.sum(axes) + mask.sum(axes) + _EPS)
    dice_loss = 1.0 - dice.mean()
    loss = bce_weight * bce + dice_weight * dice_loss
    return loss, {"bce": bce, "dice_loss": dice_loss}


def eval_sums(
    logits: jax.Array, mask: jax.Array, valid: jax.Array, *, threshold: float, bce_weight: float, dice_weight: float
) -> dict[str, jax.Array]:
    """Sums over the valid images of a batch, to be added up over the whole eval set."""
    logits = logits.astype(jnp.float32)
    pred = (jax.nn.sigmoid(logits) >= threshold).astype(jnp.float32)
    axes = tuple(range(1, pred.ndim))
    tp = (pred * mask).sum(axes)
    fp = (pred * (1 - mask)).sum(axes)
    fn = ((1 - pred) * mask).sum(axes)
    tn = ((1 - pred) * (1 - mask)).sum(axes)
    union = tp + fp + fn
    empty = union == 0
    dice = jnp.where(empty, 1.0, 2 * tp / jnp.maximum(2 * tp + fp + fn, 1))
    iou = jnp.where(empty, 1.0, tp / jnp.maximum(union, 1))
    bce = optax.sigmoid_binary_cross_entropy(logits, mask).mean(axes)
    p = jax.nn.sigmoid(logits)
    soft = (2 * (p * mask).sum(axes) + _EPS) / (p.sum(axes) + mask.sum(axes) + _EPS)
    loss = bce_weight * bce + dice_weight * (1 - soft)
    v = valid.astype(jnp.float32)
    return {
        "count": v.sum(),
        "dice_sum": (dice * v).sum(),
        "iou_sum": (iou * v).sum(),
        "loss_sum": (loss * v).sum(),
        "tp": (tp * v).sum(),
        "fp": (fp * v).sum(),
        "fn": (fn * v).sum(),
        "tn": (tn * v).sum(),
    }


def finalize_metrics(sums: Mapping[str, float]) -> dict[str, float]:
    """Turn accumulated :func:`eval_sums` into metrics (all in [0, 1] except the loss)."""
    s = {k: float(np.asarray(v, np.float64)) for k, v in sums.items()}
    n = max(s["count"], 1.0)

    def ratio(num: float, den: float) -> float:
        return num / den if den > 0 else 1.0  # nothing to find and nothing found: perfect

    return {
        "dice": s["dice_sum"] / n,
        "iou": s["iou_sum"] / n,
        "loss": s["loss_sum"] / n,
        "dice_global": ratio(2 * s["tp"], 2 * s["tp"] + s["fp"] + s["fn"]),
        "sensitivity": ratio(s["tp"], s["tp"] + s["fn"]),
        "specificity": ratio(s["tn"], s["tn"] + s["fp"]),
        "accuracy": ratio(s["tp"] + s["tn"], s["tp"] + s["tn"] + s["fp"] + s["fn"]),
        "num_images": s["count"],
    }
