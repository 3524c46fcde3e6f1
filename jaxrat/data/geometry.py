"""Geometric primitives on example dicts (image, mask, normalised boxes): resize, crop, pad and the
letterbox arithmetic, shared by the Grain transforms in :mod:`jaxrat.data.transforms` (which
re-exports them) and by evaluation at the original resolution."""

from __future__ import annotations

from typing import Sequence

import numpy as np
from PIL import Image

Example = dict[str, np.ndarray]
PER_BOX_KEYS = ("boxes", "labels", "is_crowd", "area")


def _hw(size: int | Sequence[int]) -> tuple[int, int]:
    return (int(size), int(size)) if isinstance(size, (int, np.integer)) else (int(size[0]), int(size[1]))


def pil_resize(a: np.ndarray, h: int, w: int, nearest: bool) -> np.ndarray:
    if a.shape[:2] == (h, w):
        return a
    mode = Image.NEAREST if nearest else Image.BILINEAR
    return np.asarray(Image.fromarray(a).resize((w, h), mode))


def _filter_boxes(ex: Example, keep: np.ndarray) -> Example:
    for k in PER_BOX_KEYS:
        if k in ex:
            ex[k] = ex[k][keep]
    return ex


def align_mask(ex: Example) -> Example:
    """The example with its mask on the image's pixel grid (nearest resize when they differ).

    A decoder may return the mask at its original size beside an image decoded at a reduced JPEG
    scale; :func:`resize` and :class:`RandomResizedCrop` resample such a mask once, from its
    original size to the target, and every other op aligns it first. (Resizing it to the reduced
    image and then again to the target moved lesion edges by up to a pixel.)"""
    if "mask" in ex and ex["mask"].shape[:2] != ex["image"].shape[:2]:
        ex = dict(ex)
        ex["mask"] = pil_resize(ex["mask"], *ex["image"].shape[:2], nearest=True)
    return ex


def full_size(ex: Example) -> tuple[int, int]:
    """(H, W) of the image as stored: the mask's shape when there is one (it is never decoded at a
    reduced scale), else the image's."""
    return tuple(ex["mask"].shape[:2]) if "mask" in ex else tuple(ex["image"].shape[:2])  # type: ignore[return-value]


def resize(ex: Example, h: int, w: int) -> Example:
    """Resize image and mask to (h, w), ignoring the aspect ratio; normalised boxes are unchanged.
    Image and mask are each resized from their own size (see :func:`align_mask`)."""
    ex = dict(ex)
    ex["image"] = pil_resize(ex["image"], h, w, nearest=False)
    if "mask" in ex:
        ex["mask"] = pil_resize(ex["mask"], h, w, nearest=True)
    return ex


def crop(ex: Example, y0: int, x0: int, h: int, w: int) -> Example:
    """Crop [y0, y0+h) x [x0, x0+w) (inside the image); boxes are clipped and empty ones dropped."""
    ex = dict(align_mask(ex))
    H, W = ex["image"].shape[:2]
    ex["image"] = ex["image"][y0 : y0 + h, x0 : x0 + w]
    if "mask" in ex:
        ex["mask"] = ex["mask"][y0 : y0 + h, x0 : x0 + w]
    if "boxes" in ex and len(ex["boxes"]):
        px = ex["boxes"] * np.array([W, H, W, H], np.float32) - np.array([x0, y0, x0, y0], np.float32)
        px = np.clip(px, 0, np.array([w, h, w, h], np.float32))
        keep = (px[:, 2] > px[:, 0]) & (px[:, 3] > px[:, 1])
        ex["boxes"] = (px / np.array([w, h, w, h], np.float32)).astype(np.float32)
        ex = _filter_boxes(ex, keep)
    return ex


def pad(ex: Example, h: int, w: int) -> Example:
    """Pad bottom/right with zeros (mask: background) to (h, w); boxes stay on their pixels."""
    ex = dict(align_mask(ex))
    H, W = ex["image"].shape[:2]
    if (H, W) == (h, w):
        return ex
    img = np.zeros((h, w, 3), ex["image"].dtype)
    img[:H, :W] = ex["image"]
    ex["image"] = img
    if "mask" in ex:
        m = np.zeros((h, w), ex["mask"].dtype)
        m[:H, :W] = ex["mask"]
        ex["mask"] = m
    if "boxes" in ex:
        ex["boxes"] = (ex["boxes"] * np.array([W / w, H / h, W / w, H / h], np.float32)).astype(np.float32)
    return ex


def letterbox_shape(height: int, width: int, size: int | Sequence[int]) -> tuple[int, int]:
    """(h, w) an ``height x width`` image takes inside a ``size`` canvas when its aspect is kept
    (:class:`Resize` with ``keep_aspect``; the rest is padding at the bottom/right)."""
    h, w = _hw(size)
    s = min(h / height, w / width)
    return max(1, min(h, round(height * s))), max(1, min(w, round(width * s)))
