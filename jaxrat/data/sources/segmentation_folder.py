"""Any segmentation dataset: images and masks in two folders with matching names, or a CSV of pairs.

    DATA_DIR/images/<any name>.jpg|png|tif...   DATA_DIR/masks/<same stem>.png|tif...   (one pool,
        split by ``val_fraction`` with a seed)
    DATA_DIR/train/images, DATA_DIR/train/masks, DATA_DIR/val/images, DATA_DIR/val/masks   (split folders;
        ``validation``/``valid`` and ``test`` are found too)
    DATA_DIR/pairs.csv: columns ``image,mask[,split]`` (paths relative to the CSV's folder)

A mask's stem is its image's stem, optionally followed by ``_mask``, ``_segmentation``, ``_label``
or ``_gt``. Masks are label maps: pixel value = class (a palette PNG's indices, or grey levels),
255 = ignore; ``data.label_map`` ((stored value, class), ...) maps other encodings (e.g.
``((0, 0), (128, 1), (255, 2))``). With ``model.num_classes=1`` a mask is binary by the rule of
:func:`jaxrat.data.imageio.load_mask` (ISIC's 0/255). Bad files: :mod:`jaxrat.data.badfiles`.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import logging
import os
from typing import Sequence

import grain
import numpy as np
from PIL import Image

from jaxrat.data.badfiles import BadFilePolicy
from jaxrat.data.imageio import BadFileError, load_rgb_with_size, photos_not_read, source_name, upright
from jaxrat.data.sources.folder import IMAGE_EXTENSIONS
from jaxrat.runtime.errors import ConfigError, DataError

IGNORE_INDEX = 255
MASK_SUFFIXES = ("", "_mask", "_segmentation", "_label", "_labels", "_gt", "-mask", "-label")
SPLIT_NAMES = {"train": ("train", "training"), "validation": ("val", "validation", "valid"), "test": ("test",)}


def _images_in(folder: str) -> list[str]:
    """The image files directly in ``folder``, a broken link included (the bad-file policy meets it
    as "file not found" instead of its image vanishing); images in sub-folders are warned about,
    since they are not read."""
    entries = list(os.scandir(folder))
    found = sorted(e.path for e in entries
                   if not e.is_dir() and e.name.lower().endswith(IMAGE_EXTENSIONS) and not e.name.startswith("."))
    nested = {e.name: n for e in entries if e.is_dir() and not e.name.startswith(".")
              for n in [_count_images(e.path)] if n}
    not_read = photos_not_read([e.name for e in entries if not e.is_dir()])
    if not_read:
        _warn_once(f"data: {folder} holds {not_read}; they are left out.")
    if nested:
        where = ", ".join(f"{name}/ ({n})" for name, n in sorted(nested.items())[:3])
        _warn_once(f"data: {sum(nested.values())} image(s) in sub-folders of {folder} are not read: {where}; move "
                   f"them into {os.path.basename(folder)}/ itself, or list the pairs with --config.data.pairs_csv.")
    return found


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    """Log ``message`` once per process: every split lists the same folders."""
    if message not in _WARNED:
        _WARNED.add(message)
        logging.warning("%s", message)


def _count_images(folder: str) -> int:
    return sum(1 for _, _, files in os.walk(folder) for f in files
               if f.lower().endswith(IMAGE_EXTENSIONS) and not f.startswith("."))


def _stem(path: str) -> str:
    return os.path.splitext(os.path.basename(path))[0]


def _match(images: list[str], mask_dir: str, policy: BadFilePolicy) -> list[tuple[str, str]]:
    """(image, mask) for every image whose mask (same stem, optional suffix) is in ``mask_dir``;
    an image with two candidate masks is refused, since either choice could be the wrong one."""
    masks: dict[str, list[str]] = {}
    for path in _images_in(mask_dir):
        masks.setdefault(_stem(path).lower(), []).append(path)
    pairs = []
    used: dict[str, str] = {}
    for image in images:
        stem = _stem(image).lower()
        if stem in used:  # a converted copy beside the original: one example (and one mask), not two
            _warn_once(f"data: {image} has the name of {used[stem]} (one mask for both); using {used[stem]} only.")
            continue
        used[stem] = image
        found = [m for s in MASK_SUFFIXES for m in masks.get(stem + s, ()) if m != image]
        if len(found) > 1:
            names = " and ".join(os.path.basename(m) for m in found[:3])
            raise DataError(f"{image} has {len(found)} candidate masks in {mask_dir} ({names}); remove or rename "
                            f"all but one, or list the pairs in a CSV with --config.data.pairs_csv.")
        if not found:
            policy.handle(BadFileError(image, f"no mask with its name in {mask_dir}",
                                       "add its mask or remove the image, or set --config.data.on_bad_file=skip"))
            continue
        pairs.append((image, found[0]))
    return pairs


def _split_folder(data_dir: str, split: str, images: str, masks: str) -> str | None:
    for name in SPLIT_NAMES[split]:
        d = os.path.join(data_dir, name)
        if os.path.isdir(os.path.join(d, images)) and os.path.isdir(os.path.join(d, masks)):
            return d
    return None


def _csv_pairs(path: str, policy: BadFilePolicy) -> dict[str, list[tuple[str, str]]]:
    root = os.path.dirname(os.path.abspath(path))
    try:
        # utf-8-sig: Excel's "CSV UTF-8" starts with a byte-order mark that would rename the first column.
        with open(path, newline="", encoding="utf-8-sig") as f:
            rows = list(csv.DictReader(f))
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise DataError(f"Cannot read the pairs CSV {path} ({e}); fix --config.data.pairs_csv.") from None
    if not rows or not {"image", "mask"} <= set(rows[0]):
        raise DataError(f"{path} needs the columns image,mask (and optionally split); add a header line.")
    _check_split_column(path, rows)
    out: dict[str, list[tuple[str, str]]] = {}
    for row in rows:
        image, mask = (os.path.join(root, (row[k] or "").strip()) for k in ("image", "mask"))
        if not os.path.isfile(image) or not os.path.isfile(mask):
            missing = image if not os.path.isfile(image) else mask
            policy.handle(BadFileError(missing, f"listed in {path} but not found",
                                       "fix the CSV row, or set --config.data.on_bad_file=skip"))
            continue
        out.setdefault(_split_of(row) or "pool", []).append((image, mask))
    return out


def _split_of(row: dict) -> str:
    """The split a CSV row names ("" when none, the raw value when unknown)."""
    value = (row.get("split") or "").strip().lower()
    return next((s for s, names in SPLIT_NAMES.items() if value in names), value)


def _check_split_column(path: str, rows: list[dict]) -> None:
    """Refuse split values that are no split, and rows without one beside rows with one: either
    would leave rows out of training without a word."""
    known = {name for names in SPLIT_NAMES.values() for name in names}
    unknown: dict[str, int] = {}
    for line, row in enumerate(rows, start=2):
        value = (row.get("split") or "").strip()
        if value and value.lower() not in known:
            unknown.setdefault(value, line)
    if unknown:
        value, line = next(iter(unknown.items()))
        others = f" (and {len(unknown) - 1} other unknown value(s))" if len(unknown) > 1 else ""
        raise DataError(f"{path} line {line}: split {value!r}{others} is not a split; write one of "
                        f"{', '.join(sorted(known))} in the split column, or leave it empty in every row to "
                        f"split by --config.data.val_fraction.")
    blank = [line for line, row in enumerate(rows, start=2) if not _split_of(row)]
    if blank and len(blank) < len(rows):
        raise DataError(f"{path}: {len(blank)} of {len(rows)} rows (first at line {blank[0]}) have no split while "
                        f"the others have one; give every row a split, or none to split by "
                        f"--config.data.val_fraction.")


def _split_pool(pool: list[tuple[str, str]], split: str, fraction: float, seed: int) -> list[tuple[str, str]]:
    """A seeded split of one pool: the same pairs in validation for every process and rerun.

    The pairs are ranked by a hash of the seed and the image's name, and the first ``val_fraction``
    of the ranking is the validation split. A pair's rank does not depend on the others, so images
    added to (or removed from) the folder later move at most one other pair each across the
    boundary: a resumed run, or a new run on the grown folder, keeps its validation images out of
    training (a shuffle of the whole list would move most of them)."""
    if not 0 < fraction < 1:
        raise ConfigError(f"config.data.val_fraction={fraction}; use a fraction between 0 and 1 (e.g. 0.2) to split "
                          f"one folder of pairs, or give train/ and val/ folders.")
    if split == "test":
        return []
    order = sorted(pool, key=lambda p: (_rank(seed, _stem(p[0])), p[0]))
    n_val = max(1, int(round(len(order) * fraction)))
    return sorted(order[:n_val] if split == "validation" else order[n_val:])


def _rank(seed: int, name: str) -> bytes:
    return hashlib.sha256(f"{seed}/{name}".encode()).digest()


def find_pairs(data_dir: str, split: str, *, images: str = "images", masks: str = "masks", pairs_csv: str = "",
               val_fraction: float = 0.2, seed: int = 0, policy: BadFilePolicy | None = None) -> list[tuple[str, str]]:
    """Sorted (image, mask) pairs of ``split`` ("train", "validation" or "test") of a folder dataset."""
    policy = policy or BadFilePolicy()
    if pairs_csv:
        by_split = _csv_pairs(pairs_csv if os.path.isabs(pairs_csv) else os.path.join(data_dir, pairs_csv), policy)
        if split in by_split:
            return by_split[split]
        return _split_pool(by_split.get("pool", []), split, val_fraction, seed)
    if not os.path.isdir(data_dir):
        raise DataError(f"Dataset folder {data_dir} not found; point --config.data.data_dir at a folder holding "
                        f"{images}/ and {masks}/ (or train/ and val/ with both).")
    folder = _split_folder(data_dir, split, images, masks)
    if folder is not None:
        return _match(_images_in(os.path.join(folder, images)), os.path.join(folder, masks), policy)
    if _split_folder(data_dir, "train", images, masks) is not None:
        if split == "test":
            return []
        raise DataError(f"{data_dir} has a train/ folder but no val/ folder with {images}/ and {masks}/; add one.")
    if not (os.path.isdir(os.path.join(data_dir, images)) and os.path.isdir(os.path.join(data_dir, masks))):
        raise DataError(f"No {images}/ and {masks}/ folders in {data_dir} (nor train/ and val/ holding them); "
                        f"set --config.data.images_folder/masks_folder to your folders' names, or use "
                        f"--config.data.pairs_csv.")
    pool = _match(_images_in(os.path.join(data_dir, images)), os.path.join(data_dir, masks), policy)
    return _split_pool(pool, split, val_fraction, seed)


def label_table(label_map: Sequence[Sequence[int]], num_classes: int) -> np.ndarray | None:
    """A 256-entry lookup from stored value to class (None: values are classes); unmapped values
    of a given map become the ignore index."""
    if not label_map:
        return None
    table = np.full(256, IGNORE_INDEX, np.uint8)
    for pair in label_map:
        if len(pair) != 2 or not 0 <= int(pair[0]) <= 255 or not (0 <= int(pair[1]) < num_classes
                                                                  or int(pair[1]) == IGNORE_INDEX):
            raise ConfigError(f"config.data.label_map entry {tuple(pair)}: write (stored value 0-255, class "
                              f"0-{num_classes - 1} or {IGNORE_INDEX}) pairs.")
        table[int(pair[0])] = int(pair[1])
    return table


def load_stored(path) -> np.ndarray:
    """A mask's stored values as uint8 (H, W): palette indices or grey levels (a 1-bit mask reads
    as 0 and 255, a colour one by its luminance)."""
    try:
        with Image.open(path) as img:
            img.load()
            img = upright(img, source_name(path))  # as the image it is drawn on (imageio)
            arr = np.asarray(img if img.mode in ("P", "L", "I;16", "I") else img.convert("L"))
    except (OSError, ValueError, SyntaxError) as e:
        raise BadFileError(source_name(path), f"unreadable mask ({e})",
                           "fix or remove the pair, or set --config.data.on_bad_file=skip") from None
    if arr.ndim == 3:
        arr = arr[..., 0]
    if arr.max(initial=0) > 255:
        raise BadFileError(source_name(path), f"holds value {int(arr.max())}; masks are label maps of 0-255",
                           "save the mask as an 8-bit or palette PNG")
    return arr.astype(np.uint8)


def load_labels(path, table: np.ndarray | None, num_classes: int) -> np.ndarray:
    """A mask as uint8 (H, W) classes: palette indices or grey levels, through ``table``."""
    stored = load_stored(path)
    labels = stored if table is None else table[stored]
    bad = np.unique(labels[(labels >= num_classes) & (labels != IGNORE_INDEX)])
    if bad.size:
        name = source_name(path)
        if os.path.splitext(name)[1].lower() in (".jpg", ".jpeg"):  # lossy: new values near every edge
            raise BadFileError(name, f"has label value(s) {bad[:5].tolist()} but model.num_classes={num_classes}, "
                               f"and is a JPEG, whose compression changes class values near edges",
                               "save the class maps as PNG")
        raise BadFileError(name, f"has label value(s) {bad[:5].tolist()} but model.num_classes="
                           f"{num_classes}", "set --config.model.num_classes, or map the values with "
                           "--config.data.label_map")
    return labels


@dataclasses.dataclass(frozen=True)
class DecodeLabelPair(grain.transforms.Map):
    """(image, mask) paths -> {"image": uint8 RGB, "mask": uint8 class per pixel (255: ignore)}."""

    num_classes: int
    label_map: tuple = ()
    at_least: tuple[int, int] | None = None

    def map(self, pair: tuple[str, str]) -> dict[str, np.ndarray]:
        image, (w, h) = load_rgb_with_size(pair[0], self.at_least)
        mask = load_labels(pair[1], label_table(self.label_map, self.num_classes), self.num_classes)
        if mask.shape != (h, w):
            raise BadFileError(source_name(pair[1]), f"mask is {mask.shape[1]}x{mask.shape[0]} but image "
                               f"{source_name(pair[0])} is {w}x{h}",
                               "the mask must match its image: fix or remove the pair, or set "
                               "--config.data.on_bad_file=skip")
        return {"image": image, "mask": mask}

    def original_mask(self, pair: tuple[str, str]) -> np.ndarray:
        """The mask of ``pair`` at its stored size, as classes."""
        return load_labels(pair[1], label_table(self.label_map, self.num_classes), self.num_classes)
