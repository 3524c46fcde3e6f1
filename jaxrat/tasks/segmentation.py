"""Binary segmentation (ISIC 2018 lesions): BCE + soft Dice loss, and eval metrics over a whole eval set.

Eval metrics are computed from sums, so they are exact whatever the batch split: each eval step
returns per-batch sums (inside jit, so they are reduced across all devices and hosts) and
:func:`finalize_metrics` turns the accumulated sums into Dice, IoU, sensitivity, specificity and
accuracy. Per-image Dice/IoU are averaged over images; an image whose mask and prediction are both
empty scores 1, never NaN.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import ml_collections as mlc
import numpy as np
import optax
from flax import nnx

from jaxrat.tasks.base import Batch, EvalAccumulator, host_rows
from jaxrat.tasks.image_task import ImageTask

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


METRICS = ("dice", "iou", "sensitivity", "specificity", "accuracy", "loss", "dice_global", "num_images")
# Eval images logged per evaluation (the first ones of the split).
NUM_LOGGED_IMAGES = 4


class SegmentationTask(ImageTask):
    """``config.task``: ``bce_weight``, ``dice_weight`` (loss) and ``threshold`` (eval metrics).

    A batch holds ``image`` (B, H, W, 3) ImageNet-normalised floats and ``mask`` (B, H, W, 1) in
    {0, 1}; eval batches also ``valid`` (1 for a real image, 0 for padding).
    """

    def __init__(self, config: mlc.ConfigDict) -> None:
        super().__init__(config)
        t = config.task
        missing = [k for k in ("bce_weight", "dice_weight", "threshold") if k not in t]
        if missing:
            from jaxrat.errors import ConfigError

            raise ConfigError(f"config.task lacks {', '.join(missing)} for the segmentation task; set them in the "
                              f"config file (see configs/isic.py).")
        self.bce_weight, self.dice_weight = float(t.bce_weight), float(t.dice_weight)
        self.threshold = float(t.threshold)

    def prepare_data(self, workdir: str) -> str:
        from jaxrat.data import datasets

        self.train_source, self.val_source = datasets.resolve_segmentation(
            self.config.data, workdir, seed=self.config.seed, process_index=jax.process_index())
        return f"{len(self.train_source)} train and {len(self.val_source)} validation images"

    def loss(self, model: nnx.Module, batch: Batch, rng: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        loss, parts = loss_fn(model(batch["image"]), batch["mask"], bce_weight=self.bce_weight,
                              dice_weight=self.dice_weight)
        # Exact in float32 (a sum of 0/1 pixels): a fingerprint of which examples a step saw.
        return loss, {**parts, "foreground_fraction": jnp.mean(batch["mask"])}

    def eval_step(self, model: nnx.Module, batch: Batch) -> tuple[dict[str, jax.Array], Any]:
        logits = model(batch["image"])
        sums = eval_sums(logits, batch["mask"], batch["valid"], threshold=self.threshold,
                         bce_weight=self.bce_weight, dice_weight=self.dice_weight)
        return sums, jax.nn.sigmoid(logits)

    def new_eval(self) -> EvalAccumulator:
        return _SegmentationEval(log_images=bool(self.config.train.log_images), threshold=self.threshold)

    @property
    def metric_names(self) -> tuple[str, ...]:
        return METRICS


def overlay(image: np.ndarray, truth: np.ndarray, pred: np.ndarray) -> np.ndarray:
    """The input with the ground truth tinted green and the prediction red (both: yellow).

    ``image`` (N, H, W, 3) in [0, 1]; ``truth`` and ``pred`` boolean (N, H, W, 1)."""
    tint = np.concatenate([pred, truth, np.zeros_like(pred)], -1).astype(np.float32)
    marked = (truth | pred).astype(np.float32)
    return image * (1 - 0.5 * marked) + 0.5 * tint


class _SegmentationEval(EvalAccumulator):
    def __init__(self, log_images: bool, threshold: float = 0.5) -> None:
        super().__init__()
        self._want_images, self._threshold = log_images, threshold
        self._images: dict[str, np.ndarray] = {}

    def update(self, sums: Mapping[str, jax.Array], batch: Batch, outputs: Any) -> None:
        self.add_sums(sums)
        if self._want_images and not self._images:
            from jaxrat.data.pipeline import IMAGENET_MEAN, IMAGENET_STD

            n = min(NUM_LOGGED_IMAGES, int(np.sum(batch["valid"])))
            if n == 0:  # this process's share of the first batch is all padding
                return
            probs = host_rows(outputs)[:n]
            image = np.clip((batch["image"][:n] * IMAGENET_STD + IMAGENET_MEAN) / 255.0, 0, 1)
            self._images = {
                "eval/input": image,
                "eval/mask": np.repeat(batch["mask"][:n], 3, -1),
                "eval/prediction": np.repeat(probs, 3, -1),
                "eval/overlay": overlay(image, batch["mask"][:n] > 0.5, probs >= self._threshold),
            }

    def finalize(self) -> dict[str, float]:
        return finalize_metrics(self.fetched_totals())

    def images(self) -> dict[str, np.ndarray]:
        return self._images
