"""ISIC 2018 Task 1 in its official folder layout, with an optional split file.

    DATA_DIR/ISIC2018_Task1-2_Training_Input/ISIC_0000000.jpg      (or .png; README etc. ignored)
    DATA_DIR/ISIC2018_Task1_Training_GroundTruth/ISIC_0000000_segmentation.png   (0/255)
    DATA_DIR/ISIC2018_Task1-2_Validation_Input/...    DATA_DIR/ISIC2018_Task1_Validation_GroundTruth/...
    DATA_DIR/ISIC2018_Task1-2_Test_Input/...          DATA_DIR/ISIC2018_Task1_Test_GroundTruth/...

A split file (``config.data.split_file``) re-splits every labelled image found in those folders:
a JSON object mapping a split name to a list of image ids (``"ISIC_0000000"``) or of integer
indices into the sorted list of all labelled images.

:class:`DecodePair` turns an (image, mask) pair, as paths or in-memory bytes, into an example.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from typing import Sequence

import grain
import numpy as np

from jaxrat.data import imageio
from jaxrat.data import transforms as T
from jaxrat.data.badfiles import BadFilePolicy, refuse_once
from jaxrat.data.imageio import BadFileError, load_mask, load_rgb_with_size, source_name
from jaxrat.runtime.errors import DataError

SPLIT_FOLDERS = {
    "train": ("ISIC2018_Task1-2_Training_Input", "ISIC2018_Task1_Training_GroundTruth"),
    "validation": ("ISIC2018_Task1-2_Validation_Input", "ISIC2018_Task1_Validation_GroundTruth"),
    "test": ("ISIC2018_Task1-2_Test_Input", "ISIC2018_Task1_Test_GroundTruth"),
}
_IMAGE_RE = re.compile(r"^(ISIC_\d+)\.(jpe?g|png)$", re.IGNORECASE)
# PNG first (the official format); others are accepted for masks converted by other tools.
_MASK_EXTENSIONS = ("png", "gif", "bmp", "tif", "tiff", "jpg", "jpeg")


def default_data_dir() -> str:
    """Where ISIC is looked for when ``config.data.data_dir`` is empty."""
    root = os.environ.get("JAXRAT_DATA_DIR", os.path.join(os.path.expanduser("~"), "jaxrat_data"))
    return os.path.join(root, "isic2018")


def _missing_message(data_dir: str, folder: str) -> str:
    return (
        f"ISIC 2018 data not found: looked for {os.path.join(data_dir, folder)}; download it with "
        f"`jaxrat download isic2018 --dest {data_dir}` (or pass "
        f"--config.data.data_dir=DIR), or train on synthetic data with --config isic:demo."
    )


def _folder_pairs(data_dir: str, split: str, policy: BadFilePolicy, required: bool) -> list[tuple[str, str]]:
    img_folder, mask_folder = SPLIT_FOLDERS[split]
    img_dir, mask_dir = os.path.join(data_dir, img_folder), os.path.join(data_dir, mask_folder)
    for d, folder in ((img_dir, img_folder), (mask_dir, mask_folder)):
        if not os.path.isdir(d):
            if required:
                raise DataError(_missing_message(data_dir, folder))
            return []
    pairs = []
    # Masks by lower-case name: copies made on macOS/Windows may say .PNG, or isic_ for ISIC_.
    masks = {n.lower(): n for n in sorted(os.listdir(mask_dir), reverse=True)}
    files = sorted(e.name for e in os.scandir(img_dir) if e.is_file())  # sub-folders are no images, whatever their name
    used: dict[str, str] = {}
    for name in files:
        m = _IMAGE_RE.match(name)
        if not m:  # README, LICENSE, ATTRIBUTION, metadata CSVs and superpixel files live here too
            continue
        if m.group(1).upper() in used:  # a converted copy beside the original: one example, not two
            logging.warning("%s: %s has the id of %s; using %s only", img_dir, name, used[m.group(1).upper()],
                            used[m.group(1).upper()])
            continue
        used[m.group(1).upper()] = name
        mask = os.path.join(mask_dir, f"{m.group(1)}_segmentation.png")
        found = next((masks[k] for k in (f"{m.group(1)}_segmentation.{e}".lower() for e in _MASK_EXTENSIONS)
                      if k in masks), None)
        if found:
            mask = os.path.join(mask_dir, found)
        if not os.path.isfile(mask):
            policy.handle(BadFileError(
                os.path.join(img_dir, name), f"its mask {mask} is missing",
                "restore the ground-truth folder or remove the image, or set --config.data.on_bad_file=skip",
            ))
            continue
        pairs.append((os.path.join(img_dir, name), mask))
    if required and not pairs and not any(_IMAGE_RE.match(n) for n in files):
        nested = os.path.join(img_dir, img_folder)
        if os.path.isdir(nested):  # an archive unpacked into a folder of its own name
            raise DataError(f"No ISIC_*.jpg or ISIC_*.png images in {img_dir}, but there is a {nested}; move its "
                            f"contents up one level.")
        raise DataError(f"No ISIC_*.jpg or ISIC_*.png images in {img_dir}; check --config.data.data_dir.")
    return pairs


def check_pair(image_path: str, mask_path: str) -> None:
    """Raise BadFileError unless both files have readable headers and the same size."""
    isize = imageio.probe(image_path)
    msize = imageio.probe(mask_path)
    if isize != msize:
        hint = ""
        if msize == isize[::-1] and imageio.exif_orientation(image_path) >= 5:
            # Images are read upright (EXIF applied), so a mask drawn on the stored pixels is turned.
            hint = (" (the mask fits the image as stored, before its EXIF orientation turns it: draw the mask on the "
                    "photo as viewers show it, or save the image upright without the orientation tag)")
        raise BadFileError(
            mask_path, f"mask is {msize[0]}x{msize[1]} but its image {image_path} is {isize[0]}x{isize[1]}{hint}",
            "the mask must match its image: fix or remove the pair, or set --config.data.on_bad_file=skip",
        )


def check_pairs(pairs: Sequence[tuple[str, str]], policy: BadFilePolicy, where: str) -> list[tuple[str, str]]:
    """The pairs whose headers are sound (see :mod:`jaxrat.data.badfiles`); raise if none is left."""
    good = []
    for img, mask in pairs:
        try:
            check_pair(img, mask)
            good.append((img, mask))
        except BadFileError as e:
            policy.handle(e)
    if pairs and not good:
        raise DataError(f"Every image/mask pair in {where} is bad (see the warnings above); fix the dataset.")
    return good


def _load_split_file(path: str) -> dict:
    try:
        with open(path) as f:
            spec = json.load(f)
    except FileNotFoundError:
        raise DataError(f"Split file {path} does not exist; fix --config.data.split_file.") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"Split file {path} is not valid JSON ({e}); write an object split -> list of ids.") from None
    if not isinstance(spec, dict) or not all(isinstance(v, list) for v in spec.values()):
        raise DataError(f"Split file {path} must be a JSON object mapping a split name to a list of image ids.")
    return spec


def _pairs_from_split_file(data_dir: str, split: str, split_file: str, policy: BadFilePolicy) -> list[tuple[str, str]]:
    spec = _load_split_file(split_file)
    if split not in spec:
        raise DataError(f"Split file {split_file} has no {split!r} entry (it has {sorted(spec)}); add it.")
    pool = sorted(
        (p for s in SPLIT_FOLDERS for p in _folder_pairs(data_dir, s, policy, required=False)),
        key=lambda p: os.path.basename(p[0]),
    )
    if not pool:
        raise DataError(_missing_message(data_dir, SPLIT_FOLDERS["train"][0]))
    by_id = {_IMAGE_RE.match(os.path.basename(p[0])).group(1).upper(): p for p in pool}
    out = []
    for entry in spec[split]:
        if isinstance(entry, int) and not isinstance(entry, bool):
            if not 0 <= entry < len(pool):
                raise DataError(f"Split file {split_file}: index {entry} is outside the {len(pool)} labelled images.")
            out.append(pool[entry])
        elif isinstance(entry, str) and os.path.splitext(os.path.basename(entry))[0].upper() in by_id:
            out.append(by_id[os.path.splitext(os.path.basename(entry))[0].upper()])
        elif isinstance(entry, str) and policy.skip:
            policy.handle(BadFileError(entry, f"listed in {split_file} but not found in {data_dir}"))
        else:
            raise DataError(f"Split file {split_file}: {entry!r} in {split!r} is not an image in {data_dir}; "
                            "fix the split file.")
    return out


@refuse_once
def find_pairs(
    data_dir: str, split: str, *, split_file: str = "", policy: BadFilePolicy | None = None, check: bool = True
) -> list[tuple[str, str]]:
    """Sorted (image_path, mask_path) pairs of ``split``; raise DataError naming what is missing.

    With ``check`` every pair's headers are checked (cheap) and bad pairs fail (all of them listed
    in one error) or are skipped according to ``policy`` (default: fail).
    """
    policy = policy or BadFilePolicy()
    if split_file:
        pairs = _pairs_from_split_file(data_dir, split, split_file, policy)
    elif split not in SPLIT_FOLDERS:
        raise DataError(f"Unknown ISIC split {split!r}; use one of {sorted(SPLIT_FOLDERS)} or a split file.")
    else:
        pairs = _folder_pairs(data_dir, split, policy, required=True)
    where = f"ISIC {split} split of {data_dir}"
    if not pairs:
        raise DataError(f"No usable image/mask pairs in the {where}; fix the dataset.")
    return check_pairs(pairs, policy, where) if check else pairs


@dataclasses.dataclass(frozen=True)
class DecodePair(grain.transforms.Map):
    """(image, mask) paths or :class:`~jaxrat.data.imageio.Encoded` bytes -> {"image": uint8 RGB,
    "mask": uint8 {0,1}}; the sizes must match.

    ``at_least=(w, h)`` lets JPEGs decode at a reduced scale no smaller than that. The mask keeps
    its original size then: the pipeline's first resize takes it to the target size in one
    nearest-neighbour step (:func:`jaxrat.data.transforms.align_mask`); resizing it to the reduced
    image first, then again to the target, shifted its edges by up to a pixel."""

    at_least: tuple[int, int] | None = None

    def map(self, pair: tuple[str, str]) -> T.Example:
        img_path, mask_path = pair
        image, (w, h) = load_rgb_with_size(img_path, self.at_least)
        mask = load_mask(mask_path)
        if (h, w) != mask.shape:
            raise BadFileError(
                source_name(mask_path),
                f"mask is {mask.shape[1]}x{mask.shape[0]} but image {source_name(img_path)} is {w}x{h}",
                "the mask must match its image: fix or remove the pair, or set --config.data.on_bad_file=skip",
            )
        return {"image": image, "mask": mask}

    def original_mask(self, pair: tuple[str, str]) -> np.ndarray:
        """The mask of ``pair`` at its stored size, uint8 {0, 1} (for original-resolution metrics)."""
        return load_mask(pair[1])


@dataclasses.dataclass(frozen=True)
class LoadResize(grain.transforms.Map):
    """Decode an (image, mask) pair and resize both to ``size`` x ``size``."""

    size: int
    keep_aspect: bool = False

    def map(self, pair: tuple[str, str]) -> T.Example:
        return T.Resize(self.size, self.keep_aspect).map(DecodePair((self.size, self.size)).map(pair))
