"""A synthetic two-level classification dataset: images and a CSV with a coarse and a fine label.

Each image shows one shape (circle, square, triangle: the coarse label ``shape``) in one of three
colours (the fine label ``kind`` = shape and colour, nine classes) at a random place and size on a
noisy background, so the demo trains a genus/species-like pair of heads through the real CSV
reading and image decoding code.
"""

from __future__ import annotations

import csv
import os
from typing import Sequence

import numpy as np
from PIL import Image, ImageDraw

from jaxrat.data.synthetic import location
from jaxrat.runtime.fileio import write_json

SHAPES = ("circle", "square", "triangle")
COLOURS = {"red": (200, 40, 40), "green": (40, 170, 60), "blue": (50, 70, 210)}
LABEL_COLUMNS = ("shape", "kind")
_MARKER = "jaxrat_synthetic.json"


def make_example(rng: np.random.Generator, size: int) -> tuple[np.ndarray, str, str]:
    """(uint8 RGB image, shape, kind) with the shape drawn at a random place and size."""
    base = rng.uniform(90, 170, size=3)
    img = np.clip(base + rng.normal(0, 18, size=(size, size, 3)), 0, 255).astype(np.uint8)
    shape, colour = SHAPES[rng.integers(len(SHAPES))], list(COLOURS)[rng.integers(len(COLOURS))]
    r = rng.uniform(0.18, 0.32) * size
    cx, cy = rng.uniform(r, size - r, size=2)
    pil = Image.fromarray(img)
    draw = ImageDraw.Draw(pil)
    fill = tuple(int(np.clip(c + rng.normal(0, 12), 0, 255)) for c in COLOURS[colour])
    if shape == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "square":
        draw.rectangle([cx - r, cy - r, cx + r, cy + r], fill=fill)
    else:
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    return np.asarray(pil), shape, f"{shape}_{colour}"


def write_dataset(root: str, num_train: int, num_val: int, image_size: int, seed: int = 0, *,
                  found_in: Sequence[str] = ()) -> dict[str, str]:
    """Write ``root/images/*.png`` and ``root/{train,val}.csv`` (columns image, shape, kind), once
    per set of parameters; return ``{"train": csv path, "validation": csv path}``, in the first of
    ``found_in`` (a trained run's copy, only read) that already holds them alike, else in ``root``."""
    params = {"num_train": num_train, "num_val": num_val, "image_size": image_size, "seed": seed, "version": 1}
    ready = location.written([*found_in, root], _MARKER, params)
    root = ready or root
    csvs = {"train": os.path.join(root, "train.csv"), "validation": os.path.join(root, "val.csv")}
    if ready:
        return csvs
    marker = os.path.join(root, _MARKER)
    rng = np.random.default_rng(seed)
    os.makedirs(os.path.join(root, "images"), exist_ok=True)
    index = 0
    for split, count in (("train", num_train), ("validation", num_val)):
        with open(csvs[split], "w", newline="") as f:
            out = csv.writer(f)
            out.writerow(["image", *LABEL_COLUMNS])
            for _ in range(count):
                image, shape, kind = make_example(rng, image_size)
                name = f"images/{index:06d}.png"
                Image.fromarray(image).save(os.path.join(root, name))
                out.writerow([name, shape, kind])
                index += 1
    write_json(marker, params)  # present only once every file is written
    return csvs
