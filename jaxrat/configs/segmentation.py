"""Segmentation on your own images: images/ + masks/ folders (any names), binary or multi-class.

Variants (``--config configs/segmentation.py:VARIANT``, or ``--config segmentation:VARIANT``):
  (none)  your data: ``--config.data.data_dir=DIR`` holding images/ and masks/ (matching stems; split
          by ``data.val_fraction`` with the seed) or train/ and val/ with both, or a CSV of pairs
          (``data.pairs_csv``: columns image,mask[,split]). ``model.num_classes``: 1 for binary
          masks (0/255 or 0/1), C for class maps 0..C-1 (255: ignore; ``data.label_map`` maps other
          values, ``task.class_names`` names the classes). RAT as in configs/isic.py.
  demo    synthetic discs and squares (3 classes with background) in images/ + masks/ palette PNGs;
          with ``--config.data.data_dir=DIR`` the demo's small RAT trains on your folder instead (the
          laptop route: synthetic data off, classes named by ``task.class_names``, else class_<k>).
  smoke   tiny and fast, for tests (a small U-Net).

Metrics (multi-class): Dice and IoU per class pooled over the split, their mean over the foreground
classes (eval/dice, eval/iou), pixel accuracy (docs/data.md, "Your own segmentation data").
"""

from __future__ import annotations

import ml_collections as mlc

from jaxrat.config_schema import load_config
from jaxrat.config_schema.packaged import PACKAGED_DIR
from jaxrat.data.synthetic.segmentation import CLASS_NAMES

# What ``jaxrat train --list-configs`` lists ("" is the default variant).
VARIANTS = ("", "demo", "smoke")


def get_config(arg: str | None = None) -> mlc.ConfigDict:
    """The ISIC RAT setup on a folder dataset, for ``arg`` in {None, "demo", "smoke"}."""
    variant = arg or ""
    if variant not in VARIANTS:
        raise ValueError(f"Unknown variant {variant!r} for configs/segmentation.py; use demo, smoke or none.")
    c = load_config(f"{PACKAGED_DIR}/isic.py:{variant}" if variant else f"{PACKAGED_DIR}/isic.py")
    c.data.name = "folder"
    c.data.images_folder = "images"
    c.data.masks_folder = "masks"
    c.data.pairs_csv = ""
    c.data.val_fraction = 0.2
    c.data.label_map = ()  # ((stored value, class), ...); empty: stored values are the classes
    c.task.class_names = ()
    c.task.eval_original_resolution = False
    c.checkpoint.best_metric = "eval/dice"
    if variant:
        c.model.num_classes = 3
        c.task.class_names = CLASS_NAMES  # the synthetic data's; on your data (data_dir) yours or class_<k>
    if variant == "demo":
        c.data.synthetic_image_size = 64
    if variant == "smoke":
        c.data.synthetic_image_size = 32
    return c
