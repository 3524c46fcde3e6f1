"""What a prediction writes under its output folder, mirroring the input's relative paths.

    OUT/masks/<rel>.png         segmentation: 0/255 mask at the image's original size and orientation
    OUT/probs/<rel>.png|.npy    with --save-probs: probabilities as 16-bit PNG (p * 65535) or float32 .npy
                                (multi-class: .npy only, (H, W, C), every class's probability)
    OUT/overlays/<rel>.jpg      the image with the predicted lesion tinted red
    OUT/predictions.csv         one row per image (see :data:`CSV_COLUMNS` and the task's columns)
    OUT/detections.json         detection: COCO results (image_id, category_id, bbox x, y, w, h, score)
    OUT/images.json             detection: the COCO "images" and "categories" the results refer to
    OUT/boxes/<rel>.jpg         detection: the image with its boxes drawn
    OUT/skipped.txt             one line per unreadable input: its path and why

``<rel>`` is the input's path relative to the input folder without its extension (kept when two
inputs would otherwise share a name, e.g. ``a.jpg`` and ``a.png``).
"""

from __future__ import annotations

import csv
import os
from collections import Counter
from typing import Any, Sequence

import numpy as np
from PIL import Image, ImageDraw

from jaxrat.inference.inputs import InputImage
from jaxrat.runtime import fileio
from jaxrat.runtime.errors import UserError

# Files and folders a prediction writes (and --overwrite replaces).
OUTPUT_NAMES = ("masks", "probs", "overlays", "boxes", "predictions.csv", "detections.json", "images.json",
                "skipped.txt", ".parts")


def output_names(inputs: Sequence[InputImage]) -> dict[str, str]:
    """Input name -> output stem (relative, ``/``-separated)."""
    stems = [os.path.splitext(i.name)[0] for i in inputs]
    clash = {s for s, n in Counter(s.lower() for s in stems).items() if n > 1}
    return {i.name: (i.name if s.lower() in clash else s) for i, s in zip(inputs, stems)}


def _path(out: str, folder: str, stem: str, ext: str) -> str:
    p = os.path.join(out, folder, *stem.split("/")) + ext
    os.makedirs(os.path.dirname(p), exist_ok=True)
    return p


def _save_atomic(img: Image.Image, path: str, **kw: Any) -> None:
    kw.pop("format", None)  # the extension says it (fileio.save_image)
    fileio.save_image(path, img, **kw)


def write_segmentation(out: str, stem: str, image: np.ndarray, pred: Any, save_probs: str,
                       class_names: Sequence[str] = ()) -> dict[str, Any]:
    """Mask (+ probabilities, overlay) of one image; returns its CSV row (without the image name).
    A multi-class prediction (``pred.labels``) is written by :func:`write_classes`, its probabilities
    (``save_probs="npy"`` only: a 16-bit PNG holds one channel) as (H, W, C) float32."""
    if pred.labels is not None:
        if save_probs:
            check_probs_format(save_probs, pred.class_probabilities.shape[-1])
            _save_npy(pred.class_probabilities, _path(out, "probs", stem, ".npy"))
        return write_classes(out, stem, image, pred, class_names)
    _save_atomic(Image.fromarray(pred.mask.astype(np.uint8) * 255, "L"), _path(out, "masks", stem, ".png"),
                 format="PNG")
    if save_probs == "png16":
        q = np.round(np.clip(pred.probability, 0, 1) * 65535).astype(np.uint16)
        _save_atomic(Image.fromarray(q), _path(out, "probs", stem, ".png"), format="PNG")
    elif save_probs == "npy":
        _save_npy(pred.probability, _path(out, "probs", stem, ".npy"))
    _save_atomic(Image.fromarray(overlay(image, pred.mask)), _path(out, "overlays", stem, ".jpg"), format="JPEG",
                 quality=90)
    fg = pred.mask
    return {"width": pred.width, "height": pred.height, "foreground_fraction": float(fg.mean()),
            "mean_probability": float(pred.probability.mean()),
            "mean_foreground_probability": float(pred.probability[fg].mean()) if fg.any() else 0.0}


def check_probs_format(save_probs: str, num_classes: int) -> None:
    """Refuse ``save_probs="png16"`` for a run of several classes: a 16-bit grey PNG holds one probability
    a pixel, and one file per class would be C files an image for the one array .npy holds."""
    if save_probs == "png16" and num_classes > 1:
        raise UserError(f"--save_probs png16 writes one probability per pixel, but this run predicts {num_classes} "
                        f"classes; pass --save_probs npy for each class's probability, (H, W, {num_classes}) float32.")


def _save_npy(array: np.ndarray, path: str) -> None:
    with fileio.atomic_open(path, "wb") as f:
        np.save(f, np.asarray(array, np.float32))


def write_classes(out: str, stem: str, image: np.ndarray, pred: Any, class_names: Sequence[str]) -> dict[str, Any]:
    """A class map as a palette PNG (pixel value = class, coloured per class) and a coloured overlay;
    the CSV row holds each class's share of the pixels."""
    from jaxrat.tasks.segmentation_multiclass import default_palette

    names = list(class_names) or [f"class_{k}" for k in range(int(pred.labels.max(initial=0)) + 1)]
    palette = default_palette(max(len(names), int(pred.labels.max(initial=0)) + 1))
    png = Image.fromarray(pred.labels, "P")
    png.putpalette([int(v) for v in palette.reshape(-1)] + [0] * (768 - palette.size))
    _save_atomic(png, _path(out, "masks", stem, ".png"), format="PNG")
    labels = pred.labels
    if labels.shape != image.shape[:2]:
        labels = np.asarray(Image.fromarray(labels).resize(image.shape[1::-1], Image.NEAREST))
    tinted = image.astype(np.float32)
    fg = labels > 0
    tinted[fg] = 0.5 * tinted[fg] + 0.5 * palette[labels[fg]].astype(np.float32)
    _save_atomic(Image.fromarray(tinted.astype(np.uint8)), _path(out, "overlays", stem, ".jpg"), format="JPEG",
                 quality=90)
    counts = np.bincount(pred.labels.reshape(-1), minlength=len(names)) / pred.labels.size
    return {"width": pred.width, "height": pred.height, "foreground_fraction": float(fg.mean()),
            **{f"fraction/{n}": float(counts[k]) for k, n in enumerate(names)}}


def overlay(image: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """``image`` (uint8 RGB, any size) with ``mask`` (bool, resized to it) tinted red."""
    if mask.shape != image.shape[:2]:
        mask = np.asarray(Image.fromarray(mask.astype(np.uint8) * 255).resize(image.shape[1::-1], Image.NEAREST)) > 0
    out = image.astype(np.float32)
    out[mask] = 0.55 * out[mask] + 0.45 * np.array([255, 0, 0], np.float32)
    return out.astype(np.uint8)


def classification_row(pred: Any, heads: Sequence[str], label_name: Any, top_k: int) -> dict[str, Any]:
    """Per head the ``top_k`` labels (original strings) and probabilities, best first."""
    row: dict[str, Any] = {"width": pred.width, "height": pred.height}
    for h in heads:
        p = pred.heads[h]
        order = np.argsort(-p, kind="stable")[:top_k]
        for r, c in enumerate(order, 1):
            row[f"{h}/top{r}_label"] = label_name(h, int(c))
            row[f"{h}/top{r}_probability"] = float(p[c])
    return row


def detection_results(pred: Any, image_id: int, category_ids: Sequence[int]) -> list[dict[str, Any]]:
    """COCO results of one image: boxes in original pixels as x, y, width, height."""
    out = []
    for (x1, y1, x2, y2), s, lab in zip(pred.boxes, pred.scores, pred.labels):
        out.append({"image_id": image_id, "category_id": int(category_ids[int(lab)]),
                    "bbox": [round(float(x1), 2), round(float(y1), 2), round(float(x2 - x1), 2),
                             round(float(y2 - y1), 2)], "score": round(float(s), 5)})
    return out


def draw_boxes(out: str, stem: str, image: np.ndarray, pred: Any, names: Sequence[str], min_score: float) -> None:
    """The image with the boxes scoring at least ``min_score`` and their class names."""
    img = Image.fromarray(image)
    sx, sy = image.shape[1] / max(pred.width, 1), image.shape[0] / max(pred.height, 1)
    draw = ImageDraw.Draw(img)
    for (x1, y1, x2, y2), s, lab in zip(pred.boxes, pred.scores, pred.labels):
        if s < min_score:
            continue
        box = (x1 * sx, y1 * sy, x2 * sx, y2 * sy)
        draw.rectangle(box, outline=(255, 0, 0), width=2)
        name = names[int(lab)] if int(lab) < len(names) else str(int(lab))
        draw.text((box[0] + 2, box[1] + 1), f"{name} {s:.2f}", fill=(255, 255, 0))
    _save_atomic(img, _path(out, "boxes", stem, ".jpg"), format="JPEG", quality=90)


def write_csv(path: str, rows: Sequence[dict[str, Any]]) -> None:
    """Rows (dicts) as CSV, columns in first-seen order."""
    columns: list[str] = []
    for r in rows:
        columns += [k for k in r if k not in columns]
    with fileio.atomic_open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns or ["image"])
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.8g}" if isinstance(v, float) else v) for k, v in r.items()})


def write_json(path: str, value: Any) -> None:
    """``value`` as an indented JSON file, whole or not at all."""
    fileio.write_json(path, value, indent=1)
