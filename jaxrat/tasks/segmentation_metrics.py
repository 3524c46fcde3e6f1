"""Binary segmentation metrics, defined once for both places they are computed.

On the device (inside jit, at the model's resolution) and on the host (at each image's original
resolution, :class:`OriginalResolution`) alike, an image's prediction is reduced to its confusion
counts (tp, fp, fn, tn pixels) and :func:`per_image_scores` turns counts into scores. Two
aggregations are reported, named so they cannot be confused:

* per image, then the mean over images (what ISIC 2018 Task 1 ranks by): ``dice``, ``iou``
  (Jaccard), ``jaccard_thresholded`` (the challenge score: an image's Jaccard, or 0 when it is
  below 0.65), ``sensitivity_per_image``, ``specificity_per_image``, ``accuracy_per_image``;
* pooled over every pixel of the split (the reference's torchmetrics definition):
  ``sensitivity``, ``specificity``, ``accuracy``, ``dice_global``, ``iou_global``.

A ratio with nothing to count (e.g. sensitivity of an image without lesion pixels; Dice of an
empty mask predicted empty) is 1: nothing to find and nothing found is perfect, never NaN.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import numpy as np

# ISIC 2018 Task 1: an image whose Jaccard is below this scores 0 in the challenge's ranking.
JACCARD_THRESHOLD = 0.65
# Per-image scores summed by name + "_sum" (the Dice and IoU sums keep their short names).
PER_IMAGE = ("dice", "iou", "jaccard_thresholded", "sensitivity_per_image", "specificity_per_image",
             "accuracy_per_image")
METRICS = ("dice", "iou", "jaccard_thresholded", "sensitivity", "specificity", "accuracy", "loss",
           "dice_global", "iou_global", "sensitivity_per_image", "specificity_per_image", "accuracy_per_image",
           "num_images")
# Metrics at each image's original resolution, logged as eval/orig/<name> (no loss there).
ORIGINAL_PREFIX = "orig/"
ORIGINAL_METRICS = tuple(ORIGINAL_PREFIX + m for m in METRICS if m != "loss")


def per_image_scores(tp: Any, fp: Any, fn: Any, tn: Any, xp: Any = np) -> dict[str, Any]:
    """Per-image scores (arrays like the counts) from per-image confusion counts; ``xp`` is numpy
    or jax.numpy."""

    def ratio(num: Any, den: Any) -> Any:
        return xp.where(den > 0, num / xp.maximum(den, 1), 1.0)

    iou = ratio(tp, tp + fp + fn)
    return {
        "dice": ratio(2 * tp, 2 * tp + fp + fn),
        "iou": iou,
        "jaccard_thresholded": xp.where(iou >= JACCARD_THRESHOLD, iou, 0.0),
        "sensitivity_per_image": ratio(tp, tp + fn),
        "specificity_per_image": ratio(tn, tn + fp),
        "accuracy_per_image": ratio(tp + tn, tp + tn + fp + fn),
    }


def sums_from_counts(tp: Any, fp: Any, fn: Any, tn: Any, valid: Any, xp: Any = np) -> dict[str, Any]:
    """Sums over the valid images of per-image counts: what :func:`finalize_metrics` takes."""
    v = valid.astype(tp.dtype)
    scores = per_image_scores(tp, fp, fn, tn, xp)
    sums = {f"{k}_sum": (s * v).sum() for k, s in scores.items()}
    return {"count": v.sum(), **sums, **{k: (c * v).sum() for k, c in (("tp", tp), ("fp", fp), ("fn", fn),
                                                                          ("tn", tn))}}


def finalize_metrics(sums: Mapping[str, float]) -> dict[str, float]:
    """Turn accumulated sums into metrics (all in [0, 1] except the loss, when summed)."""
    s = {k: float(np.asarray(v, np.float64)) for k, v in sums.items()}
    n = max(s["count"], 1.0)

    def ratio(num: float, den: float) -> float:
        return num / den if den > 0 else 1.0  # nothing to find and nothing found: perfect

    tp, fp, fn, tn = s["tp"], s["fp"], s["fn"], s["tn"]
    out = {k: s[f"{k}_sum"] / n for k in PER_IMAGE}
    if "loss_sum" in s:
        out["loss"] = s["loss_sum"] / n
    out.update({
        "dice_global": ratio(2 * tp, 2 * tp + fp + fn),
        "iou_global": ratio(tp, tp + fp + fn),
        "sensitivity": ratio(tp, tp + fn),
        "specificity": ratio(tn, tn + fp),
        "accuracy": ratio(tp + tn, tp + tn + fp + fn),
        "num_images": s["count"],
    })
    return out


def to_original(prob: np.ndarray, height: int, width: int, content: tuple[int, int] | None = None) -> np.ndarray:
    """A (h, w) probability map at the model's resolution resized (bilinear, pixel centres aligned
    as in PIL and torch's ``align_corners=False``) to the image's original ``height x width``.
    ``content``: the (h, w) top-left part that holds the image when it was letterboxed."""
    from PIL import Image

    if content is not None:
        prob = prob[: content[0], : content[1]]
    if prob.shape == (height, width):
        return prob
    return np.asarray(Image.fromarray(np.ascontiguousarray(prob, np.float32)).resize((width, height), Image.BILINEAR))


@dataclasses.dataclass
class OriginalResolution:
    """Confusion counts of every eval image at its original resolution, computed on the host.

    ``original_mask(i)``: eval example ``i``'s mask as stored (uint8 {0, 1}); ``content(h, w)``:
    the part of the model's input that shows an ``h x w`` original (None: the whole input, the
    image was stretched). Each process counts its own rows; :meth:`sums` gathers every process's.
    """

    original_mask: Callable[[int], np.ndarray]
    threshold: float
    content: Callable[[int, int], tuple[int, int] | None] = lambda h, w: None
    rows: list = dataclasses.field(default_factory=list)

    def update(self, probs: np.ndarray, index: Sequence[int], valid: Sequence[float]) -> None:
        """Count this process's rows of one eval batch: ``probs`` (B, h, w[, 1])."""
        for p, i, v in zip(probs, index, valid):
            if not v:  # padding, or a file skipped as bad: never opened, never counted
                self.rows.append((int(i), 0, 0, 0, 0, 0, 0, 0))
                continue
            mask = self.original_mask(int(i)).astype(bool)
            H, W = mask.shape
            pred = to_original(np.asarray(p).reshape(p.shape[:2]), H, W, self.content(H, W)) >= self.threshold
            tp = int(np.count_nonzero(pred & mask))
            fp = int(np.count_nonzero(pred)) - tp
            fn = int(np.count_nonzero(mask)) - tp
            self.rows.append((int(i), 1, tp, fp, fn, H * W - tp - fp - fn, H, W))

    def gathered(self) -> np.ndarray:
        """Every process's valid rows ``(index, 1, tp, fp, fn, tn, height, width)``, in example order
        (the same whatever the number of processes or the batch split). A collective: every
        process calls it."""
        import jax

        # int32 (JAX's default width): pixel counts of an image, exact up to 2^31 pixels.
        rows = np.asarray(self.rows, np.int32).reshape(-1, 8)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            rows = np.asarray(multihost_utils.process_allgather(rows, tiled=True))
        rows = rows[rows[:, 1] > 0]
        return rows[np.argsort(rows[:, 0], kind="stable")]

    def sums(self) -> dict[str, float]:
        """Sums over every process's valid images, in float64 and in example order."""
        rows = self.gathered().astype(np.float64)
        tp, fp, fn, tn = (rows[:, k] for k in range(2, 6))
        return sums_from_counts(tp, fp, fn, tn, rows[:, 1])

    def per_image(self, name: Callable[[int], str]) -> list[dict[str, Any]]:
        """One row per valid image: ``name(index)``, its size and scores at its original resolution."""
        rows = self.gathered()
        out = []
        for i, _, tp, fp, fn, tn, h, w in rows.tolist():
            scores = per_image_scores(*(np.float64(c) for c in (tp, fp, fn, tn)))
            out.append({"image": name(i), "width": w, "height": h, "dice": float(scores["dice"]),
                        "iou": float(scores["iou"]), "jaccard_thresholded": float(scores["jaccard_thresholded"]),
                        "sensitivity": float(scores["sensitivity_per_image"]),
                        "specificity": float(scores["specificity_per_image"]),
                        "accuracy": float(scores["accuracy_per_image"]), "tp": tp, "fp": fp, "fn": fn, "tn": tn})
        return out
