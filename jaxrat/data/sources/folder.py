"""Generic classification sources: an image folder per class, or a CSV of image path + labels.

    ROOT/<class name>/<image>          -> folder_records(ROOT)
    CSV: path,diagnosis,site,...        -> csv_records(CSV, label_columns=("diagnosis", "site"))

Each record is {"path", "labels"} with ``labels`` an int32 vector, one entry per label column
(multi-head classification). Integer columns are used as they are; text columns are mapped to
indices in sorted order of their values (the vocabularies are returned). An empty cell is -1
(missing: a loss should ignore it), so a negative number label is refused rather than read as
missing. Non-image files (README, LICENSE, .csv) are ignored.
"""

from __future__ import annotations

import csv
import dataclasses
import logging
import os
from typing import Any, Sequence

import grain
import numpy as np
from PIL import features

from jaxrat.data.badfiles import BadFilePolicy
from jaxrat.data.imageio import HEIF, HEIF_EXTENSIONS, BadFileError, load_rgb_with_size, photos_not_read
from jaxrat.runtime.errors import DataError

# AVIF where this Pillow decodes it (11.3 on), HEIC/HEIF where pillow-heif is installed.
IMAGE_EXTENSIONS = ((".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm")
                    + ((".avif",) if features.check("avif") else ()) + (HEIF_EXTENSIONS if HEIF else ()))


def _is_image_name(name: str) -> bool:
    return name.lower().endswith(IMAGE_EXTENSIONS) and not name.startswith(".")


# Folders that archivers, NAS boxes and Python leave beside the classes: never a class.
SYSTEM_FOLDERS = ("__MACOSX", "__pycache__", "@eaDir", "$RECYCLE.BIN", "System Volume Information")


def folder_records(root: str, *, policy: BadFilePolicy | None = None,
                   empty_classes: bool = False) -> tuple[list[dict], list[str]]:
    """(records, class names) of ``root/<class>/<image>``; classes in sorted order. A class folder
    without a usable image directly in it is refused (nothing to learn it from), or left out with
    ``empty_classes`` (a validation split need not hold every class); images in a class folder's
    sub-folders are not read, and said so."""
    policy = policy or BadFilePolicy()
    if not os.path.isdir(root):
        raise DataError(f"Image folder {root} not found; fix --config.data.data_dir.")
    names = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d))
                   and not d.startswith(".") and d not in SYSTEM_FOLDERS)
    records, classes = [], []
    for name in names:
        folder = os.path.join(root, name)
        listed = sorted(os.listdir(folder))
        paths = [os.path.join(folder, f) for f in listed if _is_image_name(f)
                 and not os.path.isdir(os.path.join(folder, f))]
        usable = [p for p in paths if _usable(p, policy)]
        nested = sum(1 for d, _, files in os.walk(folder) if d != folder for f in files if _is_image_name(f))
        not_read = photos_not_read(listed)
        if nested and usable:
            logging.warning("data: %d image(s) in sub-folders of %s are not read; move them into %s itself.",
                            nested, folder, name)
        if not_read and usable:
            logging.warning("data: %s holds %s; they are left out.", folder, not_read)
        if not usable:
            if empty_classes:
                continue
            why = (f"its {nested} image(s) are in sub-folders, which are not read; move them into {name}/ itself"
                   if nested else f"it holds {not_read}" if not_read else "add its images, or remove the folder")
            raise DataError(f"Class folder {folder} holds no usable image, so class {name!r} cannot be learned; {why}.")
        label = len(classes)
        classes.append(name)
        records += [{"path": p, "labels": np.array([label], np.int32)} for p in usable]
    if not records:
        raise DataError(f"No images in class sub-folders of {root}; expected ROOT/<class>/<image>.jpg.")
    return records, classes


def csv_records(
    csv_path: str,
    *,
    image_column: str = "image",
    label_columns: Sequence[str] = ("label",),
    image_root: str | None = None,
    policy: BadFilePolicy | None = None,
) -> tuple[list[dict], dict[str, list]]:
    """(records, vocabularies) from a CSV; relative image paths are under ``image_root`` (default:
    the CSV's folder). Each vocabulary lists a column's values by label index (ints: empty)."""
    policy = policy or BadFilePolicy()
    image_root = image_root or os.path.dirname(os.path.abspath(csv_path))
    try:
        # utf-8-sig: Excel's "CSV UTF-8" starts with a byte-order mark that would rename the first column.
        with open(csv_path, newline="", encoding="utf-8-sig") as f:
            # A short row gets "" for its missing cells (an empty label: -1), not None. Spaces after
            # the commas ("image, label", '..., "big, cat"') are how many people write CSVs by hand:
            # skipinitialspace keeps such a quoted cell one cell, and the header names are stripped.
            reader = csv.DictReader(f, restval="", skipinitialspace=True, delimiter=_delimiter(f))
            if reader.fieldnames:
                reader.fieldnames = [name.strip() if name else name for name in reader.fieldnames]
            rows = list(reader)
    except FileNotFoundError:
        raise DataError(f"CSV file {csv_path} not found; fix the path in the config.") from None
    except (UnicodeDecodeError, csv.Error, OSError) as e:
        raise DataError(f"CSV file {csv_path} cannot be read ({e}); save it as UTF-8 CSV.") from None
    if not rows:
        raise DataError(f"CSV file {csv_path} has no rows; add a header line and one row per image.")
    missing = [c for c in (image_column, *label_columns) if c not in rows[0]]
    if missing:
        raise DataError(f"CSV file {csv_path} has no column(s) {missing} (it has {list(rows[0])}); fix the config.")
    vocabs: dict[str, list] = {}
    maps: dict[str, dict[str, int] | None] = {}
    for col in label_columns:
        values = sorted({r[col].strip() for r in rows if r[col].strip()})
        if all(_is_int(v) for v in values):
            maps[col], vocabs[col] = None, []
        else:
            maps[col], vocabs[col] = {v: i for i, v in enumerate(values)}, values
    records = []
    for line, r in enumerate(rows, start=2):
        path = r[image_column].strip()
        if not path:
            policy.handle(BadFileError(f"{csv_path} line {line}", f"no image path in column {image_column!r}",
                                       "fill it in or delete the row, or set --config.data.on_bad_file=skip"))
            continue
        path = _local_path(path, image_root)
        labels = []
        for col in label_columns:
            v = r[col].strip()
            if v and maps[col] is None and int(v) < 0:
                # -1 is how a missing label is held: a negative class would be ignored without a word.
                raise DataError(f"{csv_path} line {line}: label {v} in column {col!r} is negative; number the "
                                f"classes from 0 (leave the cell empty for a missing label).")
            labels.append(-1 if not v else (int(v) if maps[col] is None else maps[col][v]))
        if _usable(path, policy):
            records.append({"path": path, "labels": np.array(labels, np.int32)})
    if not records:
        raise DataError(f"No usable images listed in {csv_path}; check the image column and --image_root.")
    return records, vocabs


def _delimiter(f: Any) -> str:
    """The separator of the CSV open in ``f`` (rewound): Excel in many European locales writes ``;``
    (a comma is their decimal mark), and a tab-separated file may be named .csv; the header line says."""
    header = f.readline()
    f.seek(0)
    return max((",", ";", "\t"), key=header.count) if header.strip() else ","


def _local_path(path: str, image_root: str) -> str:
    """``path`` from a CSV as a path on this machine: relative ones under ``image_root``; a CSV written
    on Windows (``images\\cat1.jpg``) has backslashes where this system has slashes, and one written
    from the folder above the dataset starts with the dataset folder's own name (``mydata/images/a.jpg``
    in ``mydata/train.csv``): both are read where they point, whatever the current folder."""
    joined = path if os.path.isabs(path) else os.path.join(image_root, path)
    if os.sep == "/" and "\\" in path and not os.path.exists(joined):
        path = path.replace("\\", "/")
        joined = path if os.path.isabs(path) else os.path.join(image_root, path)
    first, _, rest = path.partition("/")
    if (rest and first == os.path.basename(os.path.normpath(image_root)) and not os.path.isabs(path)
            and not os.path.exists(joined) and os.path.exists(os.path.join(image_root, rest))):
        joined = os.path.join(image_root, rest)
    return joined


def _is_int(v: str) -> bool:
    try:
        int(v)
        return True
    except ValueError:
        return False


def _usable(path: str, policy: BadFilePolicy) -> bool:
    problem = None
    if not os.path.isfile(path):
        problem = "file not found"
    elif os.path.getsize(path) == 0:
        problem = "file is empty"
    if problem:
        policy.handle(BadFileError(path, problem))
        return False
    return True


@dataclasses.dataclass(frozen=True)
class DecodeClassification(grain.transforms.Map):
    """Record -> {"image": uint8 RGB, "labels": int32 (heads,)}."""

    at_least: tuple[int, int] | None = None

    def map(self, rec: dict[str, Any]) -> dict[str, np.ndarray]:
        image, _ = load_rgb_with_size(rec["path"], self.at_least)
        return {"image": image, "labels": rec["labels"]}
