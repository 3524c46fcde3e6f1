"""A synthetic ISIC-like dataset written in the official ISIC 2018 Task 1 layout.

Lesion-like blobs (irregular, textured, brownish) on textured skin-coloured backgrounds with a few
hairs, plus the matching 0/255 masks. The demo and the tests read it through the same loading code
as the real data, so they exercise decoding, resizing and the per-host pipeline for real.
"""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np
from PIL import Image

from jaxrat.data.sources.isic import SPLIT_FOLDERS
from jaxrat.data.synthetic import location
from jaxrat.runtime.fileio import write_json

_MARKER = "jaxrat_synthetic.json"


def _smooth_noise(rng: np.random.Generator, h: int, w: int, cells: int) -> np.ndarray:
    """Low-frequency noise in [-1, 1]: bilinear upsampling of a coarse random grid."""
    coarse = rng.uniform(-1, 1, size=(cells, cells)).astype(np.float32)
    img = Image.fromarray(coarse, mode="F").resize((w, h), Image.BILINEAR)
    return np.asarray(img)


def make_example(rng: np.random.Generator, height: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """One (uint8 RGB image, uint8 0/255 mask) pair."""
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    skin = rng.uniform([185, 135, 110], [235, 185, 160]).astype(np.float32)
    img = skin[None, None, :] + 14 * _smooth_noise(rng, height, width, 6)[..., None]
    img += rng.normal(0, 4, size=(height, width, 1)).astype(np.float32)

    # Lesion: a star-shaped region whose radius wobbles with a few angular harmonics.
    cy, cx = rng.uniform(0.3, 0.7) * height, rng.uniform(0.3, 0.7) * width
    r0 = rng.uniform(0.14, 0.3) * min(height, width)
    theta = np.arctan2(yy - cy, xx - cx)
    radius = np.full_like(theta, r0)
    for k in range(2, 6):
        radius += r0 * rng.uniform(0, 0.12) * np.cos(k * theta + rng.uniform(0, 2 * np.pi))
    dist = np.hypot(yy - cy, xx - cx)
    mask = dist <= radius
    lesion = rng.uniform([90, 50, 30], [160, 110, 80]).astype(np.float32)
    texture = 20 * _smooth_noise(rng, height, width, 12)[..., None]
    # Soft edge (a couple of pixels) like real lesion borders; the mask stays hard.
    alpha = np.clip((radius - dist) / 2.0 + 0.5, 0, 1)[..., None]
    img = img * (1 - alpha) + (lesion[None, None, :] + texture) * alpha

    for _ in range(rng.integers(0, 4)):  # hairs: thin dark arcs crossing the image
        x0, x1 = rng.uniform(0, width, 2)
        bend = rng.uniform(-0.2, 0.2) * width
        t = yy / max(height - 1, 1)
        hx = x0 + (x1 - x0) * t + bend * t * (1 - t)
        hair = np.abs(xx - hx) < 0.7
        img[hair] = img[hair] * 0.35
    return np.clip(img, 0, 255).astype(np.uint8), (mask * 255).astype(np.uint8)


def write_dataset(data_dir: str, num_train: int, num_val: int, image_size: int, seed: int = 0, *,
                  found_in: Sequence[str] = ()) -> str:
    """Write the synthetic dataset under ``data_dir`` and return ``data_dir``; or return the first of
    ``found_in`` (a trained run's copy, only read), else ``data_dir``, that already holds it with the
    same parameters. Images are a little larger than ``image_size`` and not square, so the
    pipeline's resize is exercised."""
    params = {"num_train": num_train, "num_val": num_val, "image_size": image_size, "seed": seed, "version": 1}
    ready = location.written([*found_in, data_dir], _MARKER, params)
    if ready:
        return ready
    marker = os.path.join(data_dir, _MARKER)
    rng = np.random.default_rng(seed)
    height, width = int(image_size * 1.125), int(image_size * 1.25)
    start = 0
    for split, count in (("train", num_train), ("validation", num_val)):
        img_dir, mask_dir = (os.path.join(data_dir, f) for f in SPLIT_FOLDERS[split])
        os.makedirs(img_dir, exist_ok=True)
        os.makedirs(mask_dir, exist_ok=True)
        for i in range(start, start + count):
            image, mask = make_example(rng, height, width)
            name = f"ISIC_{i:07d}"
            Image.fromarray(image).save(os.path.join(img_dir, f"{name}.jpg"), quality=92)
            Image.fromarray(mask).save(os.path.join(mask_dir, f"{name}_segmentation.png"))
        start += count
    write_json(marker, params)  # the marker appears only once every file is written
    return data_dir
