"""ISIC 2018 Task 1 in its official folder layout.

    DATA_DIR/ISIC2018_Task1-2_Training_Input/ISIC_0000000.jpg
    DATA_DIR/ISIC2018_Task1_Training_GroundTruth/ISIC_0000000_segmentation.png
    DATA_DIR/ISIC2018_Task1-2_Validation_Input/...
    DATA_DIR/ISIC2018_Task1_Validation_GroundTruth/...
"""

from __future__ import annotations

import os
import re

from jaxrat.errors import DataError

SPLIT_FOLDERS = {
    "train": ("ISIC2018_Task1-2_Training_Input", "ISIC2018_Task1_Training_GroundTruth"),
    "validation": ("ISIC2018_Task1-2_Validation_Input", "ISIC2018_Task1_Validation_GroundTruth"),
    "test": ("ISIC2018_Task1-2_Test_Input", "ISIC2018_Task1_Test_GroundTruth"),
}
_IMAGE_RE = re.compile(r"^(ISIC_\d+)\.(jpe?g|png)$", re.IGNORECASE)


def default_data_dir() -> str:
    """Where ISIC is looked for when ``config.data.data_dir`` is empty."""
    root = os.environ.get("JAXRAT_DATA_DIR", os.path.join(os.path.expanduser("~"), "jaxrat_data"))
    return os.path.join(root, "isic2018")


def _missing_message(data_dir: str, folder: str) -> str:
    return (
        f"ISIC 2018 data not found: looked for {os.path.join(data_dir, folder)}; download ISIC 2018 "
        f"Task 1 from https://challenge.isic-archive.com/data/#2018 and unzip it there (or pass "
        f"--config.data.data_dir=DIR), or train on synthetic data with --config configs/isic.py:demo."
    )


def find_pairs(data_dir: str, split: str) -> list[tuple[str, str]]:
    """Return sorted (image_path, mask_path) pairs of ``split``; raise DataError naming what is missing."""
    if split not in SPLIT_FOLDERS:
        raise DataError(f"Unknown ISIC split {split!r}; use one of {sorted(SPLIT_FOLDERS)}.")
    img_folder, mask_folder = SPLIT_FOLDERS[split]
    img_dir = os.path.join(data_dir, img_folder)
    mask_dir = os.path.join(data_dir, mask_folder)
    if not os.path.isdir(img_dir):
        raise DataError(_missing_message(data_dir, img_folder))
    if not os.path.isdir(mask_dir):
        raise DataError(_missing_message(data_dir, mask_folder))
    pairs = []
    for name in sorted(os.listdir(img_dir)):
        m = _IMAGE_RE.match(name)
        if not m:  # README, LICENSE, metadata CSVs and superpixel files live here too
            continue
        mask = os.path.join(mask_dir, f"{m.group(1)}_segmentation.png")
        if not os.path.isfile(mask):
            raise DataError(
                f"Mask missing for image {os.path.join(img_dir, name)}: expected {mask}; "
                f"restore the ground-truth folder or remove the image."
            )
        pairs.append((os.path.join(img_dir, name), mask))
    if not pairs:
        raise DataError(f"No ISIC_*.jpg or ISIC_*.png images in {img_dir}; check --config.data.data_dir.")
    return pairs
