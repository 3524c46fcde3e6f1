"""A synthetic COCO 2017 detection dataset in the official layout, for demos and tests.

Coloured rectangles and ellipses (colour and shape follow the class) on textured backgrounds,
with the real 80 COCO categories and their non-contiguous ids, one crowd annotation now and
then, an image without objects, and a README in the image folder, so the loader's id mapping,
crowd and empty-image handling and stray-file tolerance are exercised for real.
"""

from __future__ import annotations

import json
import os
from typing import Sequence

import numpy as np
from PIL import Image, ImageDraw

from jaxrat.data.synthetic import location
from jaxrat.runtime.fileio import write_json

# The 80 COCO 2017 detection categories (id, name).
_NAMES = (
    "person bicycle car motorcycle airplane bus train truck boat traffic_light fire_hydrant - stop_sign "
    "parking_meter bench bird cat dog horse sheep cow elephant bear zebra giraffe - backpack umbrella - - "
    "handbag tie suitcase frisbee skis snowboard sports_ball kite baseball_bat baseball_glove skateboard "
    "surfboard tennis_racket bottle - wine_glass cup fork knife spoon bowl banana apple sandwich orange "
    "broccoli carrot hot_dog pizza donut cake chair couch potted_plant bed - dining_table - - toilet - tv "
    "laptop mouse remote keyboard cell_phone microwave oven toaster sink refrigerator - book clock vase "
    "scissors teddy_bear hair_drier toothbrush"
).split()
COCO_CATEGORIES = tuple((i + 1, n.replace("_", " ")) for i, n in enumerate(_NAMES) if n != "-")
_MARKER = "jaxrat_synthetic_coco.json"


def _draw_image(rng: np.random.Generator, h: int, w: int, objects: list[tuple[int, list[float]]]) -> np.ndarray:
    base = rng.uniform(60, 200, 3)
    img = Image.fromarray(np.clip(base + rng.normal(0, 12, (h, w, 3)), 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(img)
    for label, (x, y, bw, bh) in objects:
        colour = tuple(int(c) for c in np.random.default_rng(label).integers(0, 255, 3))
        shape = draw.ellipse if label % 2 else draw.rectangle
        shape([x, y, x + bw - 1, y + bh - 1], fill=colour)
    return np.asarray(img)


def write_coco(root: str, num_train: int = 16, num_val: int = 8, image_size: int = 64, seed: int = 0,
               num_classes: int = 5, *, found_in: Sequence[str] = ()) -> str:
    """Write ``root/{train2017,val2017}/*.jpg`` and ``root/annotations/instances_*.json``; objects
    use the first ``num_classes`` COCO categories. Returns ``root``, or the first of ``found_in`` (a
    trained run's copy, only read), else ``root``, that already holds the same data (nothing written)."""
    params = {"num_train": num_train, "num_val": num_val, "image_size": image_size, "seed": seed,
              "num_classes": num_classes, "version": 1}
    ready = location.written([*found_in, root], _MARKER, params)
    if ready:
        return ready
    marker = os.path.join(root, _MARKER)
    rng = np.random.default_rng(seed)
    # Spread over the id range so the contiguous label mapping is exercised (ids 1, 17, 34, ...).
    used = COCO_CATEGORIES[:: max(1, len(COCO_CATEGORIES) // num_classes)][:num_classes]
    os.makedirs(os.path.join(root, "annotations"), exist_ok=True)
    image_id, ann_id = 1, 1
    for folder, count in (("train2017", num_train), ("val2017", num_val)):
        os.makedirs(os.path.join(root, folder), exist_ok=True)
        with open(os.path.join(root, folder, "README.txt"), "w") as f:
            f.write("synthetic COCO-layout images written by jaxrat.data.synthetic.coco\n")
        images, anns = [], []
        for i in range(count):
            h, w = image_size, int(image_size * rng.uniform(1.0, 1.5))
            objects = []
            n_obj = 0 if i == 1 else int(rng.integers(1, 4))  # image #1 has no objects
            for _ in range(n_obj):
                bw, bh = (float(v) for v in rng.integers(max(4, w // 8), max(5, w // 2), 2))
                bh = min(bh, h - 1)
                x, y = float(rng.integers(0, w - bw)), float(rng.integers(0, h - bh))
                cat_id, _ = used[int(rng.integers(0, len(used)))]
                objects.append((cat_id, [x, y, bw, bh]))
            file_name = f"{image_id:012d}.jpg"
            Image.fromarray(_draw_image(rng, h, w, objects)).save(os.path.join(root, folder, file_name), quality=95)
            images.append({"id": image_id, "file_name": file_name, "width": w, "height": h})
            for cat_id, box in objects:
                x, y, bw, bh = box
                anns.append({"id": ann_id, "image_id": image_id, "category_id": cat_id, "bbox": box,
                             "area": bw * bh, "iscrowd": 0,
                             "segmentation": [[x, y, x + bw, y, x + bw, y + bh, x, y + bh]]})
                ann_id += 1
            if i % 4 == 2:  # a crowd region over the image's left part, as COCO marks groups
                cw, ch = w // 3, h // 2
                counts = _rle_rect(h, w, 0, 0, cw, ch)
                anns.append({"id": ann_id, "image_id": image_id, "category_id": used[0][0],
                             "bbox": [0.0, 0.0, float(cw), float(ch)], "area": float(cw * ch), "iscrowd": 1,
                             "segmentation": {"counts": counts, "size": [h, w]}})
                ann_id += 1
            image_id += 1
        spec = {"info": {"description": "jaxrat synthetic COCO"}, "licenses": [], "images": images,
                "annotations": anns, "categories": [{"id": c, "name": n, "supercategory": "thing"}
                                                     for c, n in COCO_CATEGORIES]}
        with open(os.path.join(root, "annotations", f"instances_{folder}.json"), "w") as f:
            json.dump(spec, f)
    write_json(marker, params)  # the marker appears only once every file is written
    return root


def _rle_rect(h: int, w: int, x0: int, y0: int, cw: int, ch: int) -> list[int]:
    """Uncompressed COCO RLE (column-major run lengths starting with background) of a rectangle."""
    m = np.zeros((h, w), np.uint8)
    m[y0 : y0 + ch, x0 : x0 + cw] = 1
    flat = m.flatten(order="F")
    counts, prev, run = [], 0, 0
    for v in flat:
        if v != prev:
            counts.append(run)
            prev, run = v, 0
        run += 1
    counts.append(run)
    return counts
