"""A synthetic multi-class segmentation dataset in plain ``images/`` + ``masks/`` folders.

Each image holds up to one disc (class 1, reddish) and one square (class 2, bluish) on a noisy
grey background; its mask is a palette PNG of class indices with the same stem under an arbitrary
name, a few boundary pixels marked 255 (ignore). The demo and the tests read it through the folder
source (:mod:`jaxrat.data.sources.segmentation_folder`) exactly as they would a user's dataset.
"""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np
from PIL import Image

from jaxrat.data.synthetic import location
from jaxrat.runtime.fileio import write_json

_MARKER = "jaxrat_synthetic.json"
# The classes the demo's masks hold, by index (configs/segmentation.py's demo and smoke name them so).
CLASS_NAMES = ("background", "disc", "square")
# Class colours of the masks' palette (background, disc, square); the rest of the palette is black.
PALETTE = ((0, 0, 0), (220, 40, 40), (40, 80, 220))


def make_example(rng: np.random.Generator, size: int) -> tuple[np.ndarray, np.ndarray]:
    """One (uint8 RGB image, uint8 class mask) pair of side ``size``."""
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    img = np.full((size, size, 3), 128, np.float32) + rng.normal(0, 12, (size, size, 3))
    mask = np.zeros((size, size), np.uint8)
    if rng.random() < 0.85:
        (cy, cx), r = rng.uniform(0.25, 0.75, 2) * size, rng.uniform(0.1, 0.2) * size
        disc = np.hypot(yy - cy, xx - cx) <= r
        img[disc] = img[disc] * 0.3 + np.array([200, 60, 50]) * 0.7
        mask[disc] = 1
    if rng.random() < 0.85:
        half = rng.uniform(0.08, 0.16) * size
        cy, cx = rng.uniform(0.2, 0.8, 2) * size
        square = (np.abs(yy - cy) <= half) & (np.abs(xx - cx) <= half)
        img[square] = img[square] * 0.3 + np.array([50, 90, 210]) * 0.7
        mask[square] = 2
    edge = np.zeros_like(mask, bool)
    edge[1:] |= mask[1:] != mask[:-1]
    mask[edge & (rng.random(mask.shape) < 0.3)] = 255  # a few unsure boundary pixels: ignored
    return np.clip(img, 0, 255).astype(np.uint8), mask


def palette_png(mask: np.ndarray) -> Image.Image:
    """A class mask as a palette PNG (index = class), coloured by :data:`PALETTE`."""
    img = Image.fromarray(mask, mode="P")
    flat = [c for rgb in PALETTE for c in rgb]
    img.putpalette(flat + [0] * (768 - len(flat) - 3) + [255, 255, 255])  # 255 (ignore) white
    return img


def write_dataset(root: str, num_images: int, size: int, seed: int, *, found_in: Sequence[str] = ()) -> str:
    """Write ``root/images/*.jpg`` and ``root/masks/*.png`` and return ``root``; or return the first of
    ``found_in`` (a trained run's copy, only read), else ``root``, that already holds them alike."""
    spec = {"num_images": num_images, "size": size, "seed": seed, "kind": "multiclass"}
    ready = location.written([*found_in, root], _MARKER, spec)
    if ready:
        return ready
    marker = os.path.join(root, _MARKER)
    rng = np.random.default_rng(seed)
    for sub in ("images", "masks"):
        os.makedirs(os.path.join(root, sub), exist_ok=True)
    for i in range(num_images):
        image, mask = make_example(rng, size)
        name = f"scan {i:04d}-{'ab'[i % 2]}"  # any names: spaces, dashes, no common prefix
        Image.fromarray(image).save(os.path.join(root, "images", name + ".jpg"), quality=95)
        palette_png(mask).save(os.path.join(root, "masks", name + ".png"))
    write_json(marker, spec)
    return root
