"""Eval images for detection: a fixed few eval images with their true boxes (green) and the
model's confident detections (red), for the trackers."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

NUM_LOGGED_IMAGES = 4
MIN_SCORE = 0.3  # detections below this are left off the picture (COCOeval still scores them)
GREEN, RED = np.array([0.0, 1.0, 0.0]), np.array([1.0, 0.0, 0.0])


def draw_boxes(image: np.ndarray, boxes: np.ndarray, color: np.ndarray, width: int = 1) -> np.ndarray:
    """``image`` (H, W, 3) in [0, 1] with the outlines of ``boxes`` (K, 4), normalised xyxy, drawn in place."""
    h, w = image.shape[:2]
    for x0, y0, x1, y1 in np.clip(boxes, 0.0, 1.0):
        c0, c1 = int(x0 * (w - 1)), int(round(x1 * (w - 1)))
        r0, r1 = int(y0 * (h - 1)), int(round(y1 * (h - 1)))
        image[r0:r0 + width, c0:c1 + 1] = color
        image[max(r1 - width + 1, 0):r1 + 1, c0:c1 + 1] = color
        image[r0:r1 + 1, c0:c0 + width] = color
        image[r0:r1 + 1, max(c1 - width + 1, 0):c1 + 1] = color
    return image


def boxes_images(batch: Mapping[str, Any], local: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``{"eval/input", "eval/boxes"}`` for the first few valid images of ``batch`` (this process's
    rows); ``local["boxes"]`` canvas-normalised xyxy and ``local["scores"]`` per detection."""
    from jaxrat.data.pipeline import IMAGENET_MEAN, IMAGENET_STD

    n = min(NUM_LOGGED_IMAGES, int(np.sum(batch["valid"])))
    if n == 0:
        return {}
    images = np.clip((np.asarray(batch["image"][:n]) * IMAGENET_STD + IMAGENET_MEAN) / 255.0, 0, 1)
    drawn = images.copy()
    for i in range(n):
        cx, cy, bw, bh = np.moveaxis(np.asarray(batch["boxes"][i], np.float32), -1, 0)
        truth = np.stack([cx - bw / 2, cy - bh / 2, cx + bw / 2, cy + bh / 2], -1)
        draw_boxes(drawn[i], truth[np.asarray(batch["box_valid"][i]) > 0], GREEN)
        draw_boxes(drawn[i], local["boxes"][i][local["scores"][i] >= MIN_SCORE], RED)
    return {"eval/input": images, "eval/boxes": drawn}
