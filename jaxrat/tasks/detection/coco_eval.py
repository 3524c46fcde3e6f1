"""COCO box AP/AR of detections, scored by pycocotools' COCOeval against the official annotation file.

Detections come from the model as normalised ``x1, y1, x2, y2`` boxes with contiguous labels
(``jaxrat.data.sources.coco``); :func:`to_coco_results` turns them back into COCO's pixel
``x, y, w, h`` and category ids, and :func:`evaluate` scores them. Crowd regions are handled by
COCOeval itself, which is why it gets the original file rather than the training targets.
"""

from __future__ import annotations

import contextlib
import io
from typing import Any, Sequence

import numpy as np

from jaxrat.data.sources.coco import load_annotations

STAT_NAMES = ("AP", "AP50", "AP75", "AP_small", "AP_medium", "AP_large",
              "AR1", "AR10", "AR100", "AR_small", "AR_medium", "AR_large")


def to_coco_results(
    category_ids: Sequence[int], image_ids: np.ndarray, boxes: np.ndarray, scores: np.ndarray, labels: np.ndarray,
    sizes: np.ndarray,
) -> list[dict[str, Any]]:
    """Detections (normalised xyxy, contiguous labels) as COCO result dicts (pixel xywh, category ids).

    ``sizes`` holds each image's original (width, height); shapes are (N,), (N, 4), (N,), (N,), (N, 2)."""
    out = []
    for iid, b, s, lab, (w, h) in zip(image_ids, boxes, scores, labels, sizes):
        x1, y1, x2, y2 = (float(v) for v in b * np.array([w, h, w, h]))
        out.append({"image_id": int(iid), "category_id": int(category_ids[int(lab)]),
                    "bbox": [x1, y1, x2 - x1, y2 - y1], "score": float(s)})
    return out


def evaluate(annotation_path: str, results: list[dict[str, Any]]) -> dict[str, float]:
    """COCO box AP/AR of ``results`` against the official annotation file, named as :data:`STAT_NAMES`."""
    from pycocotools.cocoeval import COCOeval

    gt = load_annotations(annotation_path)
    if not results:
        return {k: 0.0 for k in STAT_NAMES}
    with contextlib.redirect_stdout(io.StringIO()):  # COCOeval prints its tables
        dt = gt.loadRes(results)
        ev = COCOeval(gt, dt, "bbox")
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    return {k: float(v) for k, v in zip(STAT_NAMES, ev.stats)}


def per_category_ap(annotation_path: str, results: list[dict[str, Any]]) -> dict[str, float]:
    """COCO AP (IoU 0.50:0.95, all areas, 100 detections) of each category, by category name;
    -1 for a category without ground truth in the split."""
    from pycocotools.cocoeval import COCOeval

    gt = load_annotations(annotation_path)
    names = {c: gt.cats[c]["name"] for c in sorted(gt.getCatIds())}
    if not results:
        return {n: 0.0 for n in names.values()}
    with contextlib.redirect_stdout(io.StringIO()):
        ev = COCOeval(gt, gt.loadRes(results), "bbox")
        ev.evaluate()
        ev.accumulate()
    precision = ev.eval["precision"]  # (iou thresholds, recall points, categories, areas, max dets)
    out = {}
    for k, c in enumerate(ev.params.catIds):
        p = precision[:, :, k, 0, -1]
        out[names[c]] = float(p[p > -1].mean()) if (p > -1).any() else -1.0
    return out
