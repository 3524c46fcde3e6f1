"""DETR set-prediction losses on Hungarian-matched pairs, with auxiliary losses per decoder layer.

Normalisation. Box losses (and the focal class loss) are sums over the whole global batch divided
by ``num_boxes``, the number of real target boxes across all devices, so every device's rows weigh
the same whatever their box count. How the caller gets it:

- inside jaxrat's jitted GSPMD train step (batch sharded by ``NamedSharding``): the arrays are
  global, so ``num_target_boxes(batch["valid"])`` (a ``jnp.sum``) already counts every device's
  boxes; XLA adds the all-reduce;
- inside ``shard_map`` (per-device arrays): ``num_target_boxes(valid, axis_name=AXES)`` psums it;
- with gradient accumulation each micro-batch is normalised by its own count (as DETR does).

The softmax cross-entropy is DETR's weighted mean over all queries of the batch (no-object weight
``eos_coef``), again global under GSPMD.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from jaxrat.tasks.detection import boxes as box_ops
from jaxrat.tasks.detection.matching import Match, hungarian_match, match_cost

Matcher = Callable[[jax.Array, jax.Array], Match]


def num_target_boxes(target_valid: jax.Array, axis_name: str | tuple[str, ...] | None = None) -> jax.Array:
    """Number of real target boxes, at least 1 (a batch with no boxes must not divide by zero).

    Pass ``axis_name`` only inside ``shard_map``; under ``jit`` with sharded arrays the sum is global.
    """
    n = jnp.sum(target_valid.astype(jnp.float32))
    if axis_name is not None:
        n = jax.lax.psum(n, axis_name)
    return jnp.maximum(n, 1.0)


def _gather_targets(match: Match, target_labels: jax.Array, target_boxes: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per query: its matched target's label and box (padding values where unmatched)."""
    labels = jnp.take_along_axis(target_labels, match.target_index, axis=1)
    boxes = jnp.take_along_axis(target_boxes, match.target_index[..., None], axis=1)
    return labels, boxes


def sigmoid_focal_loss(logits: jax.Array, targets: jax.Array, *, alpha: float = 0.25, gamma: float = 2.0) -> jax.Array:
    """Elementwise focal loss (Lin et al. 2017) of sigmoid ``logits`` against 0/1 ``targets``."""
    p = jax.nn.sigmoid(logits)
    ce = -(targets * jax.nn.log_sigmoid(logits) + (1.0 - targets) * jax.nn.log_sigmoid(-logits))
    p_t = p * targets + (1.0 - p) * (1.0 - targets)
    alpha_t = alpha * targets + (1.0 - alpha) * (1.0 - targets)
    return alpha_t * (1.0 - p_t) ** gamma * ce


def matched_losses(logits: jax.Array, pred_boxes: jax.Array, target_labels: jax.Array, target_boxes: jax.Array,
                   match: Match, num_boxes: jax.Array, *, focal: bool = False, eos_coef: float = 0.1,
                   focal_alpha: float = 0.25, focal_gamma: float = 2.0) -> dict[str, jax.Array]:
    """Unweighted ``loss_ce``, ``loss_bbox`` (L1) and ``loss_giou`` of one decoder layer's outputs.

    Args:
      logits: ``(B, Q, K + 1)`` (last = no object) or ``(B, Q, K)`` when ``focal``.
      pred_boxes: ``(B, Q, 4)`` normalised ``(cx, cy, w, h)``.
      target_labels, target_boxes: ``(B, T)`` int and ``(B, T, 4)`` padded targets.
      match: the assignment of this layer's predictions (:func:`hungarian_match`).
      num_boxes: global number of real targets (:func:`num_target_boxes`).
    """
    logits = logits.astype(jnp.float32)
    pred_boxes = pred_boxes.astype(jnp.float32)
    labels_q, boxes_q = _gather_targets(match, target_labels.astype(jnp.int32), target_boxes.astype(jnp.float32))
    matched = match.query_matched
    if focal:
        num_classes = logits.shape[-1]
        onehot = jax.nn.one_hot(labels_q, num_classes) * matched[..., None]
        loss_ce = sigmoid_focal_loss(logits, onehot, alpha=focal_alpha, gamma=focal_gamma).sum() / num_boxes
    else:
        no_object = logits.shape[-1] - 1
        classes = jnp.where(matched, labels_q, no_object)
        nll = -jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), classes[..., None], axis=-1)[..., 0]
        weight = jnp.where(matched, 1.0, eos_coef)
        loss_ce = (weight * nll).sum() / weight.sum()
    # Unmatched queries' box terms are masked out; their gathered (padding) boxes never reach a NaN
    # because the box ops are safe on zero-area boxes.
    l1 = jnp.abs(pred_boxes - boxes_q).sum(-1)
    giou = box_ops.elementwise_giou(box_ops.cxcywh_to_xyxy(pred_boxes), box_ops.cxcywh_to_xyxy(boxes_q))
    return {"loss_ce": loss_ce,
            "loss_bbox": jnp.where(matched, l1, 0.0).sum() / num_boxes,
            "loss_giou": jnp.where(matched, 1.0 - giou, 0.0).sum() / num_boxes}


def set_criterion(layers: Sequence[tuple[jax.Array, jax.Array]], target_labels: jax.Array, target_boxes: jax.Array,
                  target_valid: jax.Array, num_boxes: jax.Array, *, matcher: Matcher = hungarian_match,
                  cost_class: float = 1.0, cost_bbox: float = 5.0, cost_giou: float = 2.0,
                  ce_weight: float = 1.0, bbox_weight: float = 5.0, giou_weight: float = 2.0,
                  focal: bool = False, eos_coef: float = 0.1, focal_alpha: float = 0.25,
                  focal_gamma: float = 2.0) -> tuple[jax.Array, dict[str, jax.Array]]:
    """DETR's loss summed over decoder layers, each layer matched on its own.

    Args:
      layers: ``(logits, pred_boxes)`` per decoder layer, the final layer **last**; earlier ones are
        the auxiliary outputs (give one pair for no auxiliary losses).
      target_labels, target_boxes, target_valid: ``(B, T)``, ``(B, T, 4)`` cxcywh, ``(B, T)`` bool.
      num_boxes: global number of real targets (:func:`num_target_boxes`; see the module docstring).
      matcher: ``(cost, valid) -> Match``; in a sharded step pass
        ``functools.partial(hungarian_match, mesh=mesh)`` so matching stays on each device.
      cost_*: matching cost weights; ``*_weight``: loss weights (DETR: 1, 5, 2 for both).

    Returns:
      ``(total, parts)``: ``total = sum over layers of ce_weight * loss_ce + bbox_weight * loss_bbox +
      giou_weight * loss_giou``; ``parts`` holds the unweighted final-layer ``loss_ce``,
      ``loss_bbox``, ``loss_giou`` and auxiliary layer ``i``'s as ``loss_ce_{i}`` etc.
    """
    if not layers:
        raise ValueError("set_criterion needs the outputs of at least one decoder layer.")
    weights = {"loss_ce": ce_weight, "loss_bbox": bbox_weight, "loss_giou": giou_weight}
    total = jnp.zeros((), jnp.float32)
    parts: dict[str, jax.Array] = {}
    for i, (logits, pred_boxes) in enumerate(layers):
        # The assignment is a constant of the loss: no gradient through the cost matrix is needed.
        cost = match_cost(jax.lax.stop_gradient(logits), jax.lax.stop_gradient(pred_boxes), target_labels,
                          target_boxes, target_valid, w_class=cost_class, w_l1=cost_bbox, w_giou=cost_giou,
                          focal=focal, focal_alpha=focal_alpha, focal_gamma=focal_gamma)
        match = matcher(cost, target_valid)
        layer = matched_losses(logits, pred_boxes, target_labels, target_boxes, match, num_boxes, focal=focal,
                               eos_coef=eos_coef, focal_alpha=focal_alpha, focal_gamma=focal_gamma)
        suffix = "" if i == len(layers) - 1 else f"_{i}"
        for name, value in layer.items():
            parts[name + suffix] = value
            total = total + weights[name] * value
    return total, parts
