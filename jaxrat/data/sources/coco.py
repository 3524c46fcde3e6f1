"""COCO 2017 detection in its official layout, read through pycocotools.

    ROOT/annotations/instances_train2017.json   ROOT/train2017/000000000009.jpg ...
    ROOT/annotations/instances_val2017.json     ROOT/val2017/...

Labels are contiguous ``0..K-1`` in ascending COCO category id (80 classes for COCO 2017);
:attr:`CocoDetection.category_ids` keeps the mapping back for evaluation
(``jaxrat.tasks.detection.coco_eval``). Boxes are normalised ``x1, y1, x2, y2`` in [0, 1]
(COCO stores pixel ``x, y, w, h``), clipped to the image; boxes with no area are dropped.

Crowd annotations (``iscrowd=1``, one box over a group of objects) are handled as COCO does:
they are not objects to detect, so they are left out of the training targets (DETR and
detectron2 do the same) unless ``include_crowd`` asks for them with ``is_crowd=1``; COCOeval,
given the original annotation file, ignores detections that fall on them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import logging
import os
from typing import Any, Sequence

import grain
import numpy as np

from jaxrat.data import transforms as T
from jaxrat.data.badfiles import BadFilePolicy
from jaxrat.data.imageio import BadFileError, exif_orientation, load_rgb_with_size
from jaxrat.data.pipeline import ExampleSource
from jaxrat.runtime.errors import DataError

SPLITS = {"train": "train2017", "validation": "val2017", "val": "val2017"}


def annotation_file(root: str, split: str) -> str:
    """Path of the official instances file of ``split``."""
    return os.path.join(root, "annotations", f"instances_{SPLITS[split]}.json")


def load_annotations(path: str):
    """The pycocotools ``COCO`` index of an annotation file; a missing, invalid or non-COCO file is a
    DataError naming what is wrong and where."""
    from pycocotools.coco import COCO

    if not os.path.isfile(path):
        raise DataError(f"COCO annotation file {path} not found; {_layout_hint(path)}")
    try:
        with open(path, encoding="utf-8") as f:
            spec = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as e:
        raise DataError(f"COCO annotation file {path} is not valid ({type(e).__name__}: {e}); "
                        "fix or re-download it.") from None
    _check_instances(spec, path)
    coco = COCO()
    coco.dataset = spec
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints progress lines
        coco.createIndex()
    return coco


def _layout_hint(path: str) -> str:
    """The fix for a missing instances file: where your own COCO-format file goes (naming the JSON
    files the dataset folder holds instead), or the download of COCO 2017."""
    root = os.path.dirname(os.path.dirname(path))
    split_folder = os.path.basename(path)[len("instances_"):-len(".json")]
    found = sorted(os.path.relpath(os.path.join(d, f), root) for d in (root, os.path.dirname(path)) if os.path.isdir(d)
                   for f in os.listdir(d) if f.lower().endswith(".json"))
    if found:
        return (f"{root} holds {', '.join(found[:3])}: jaxrat reads COCO 2017's layout, so move it to {path} and its "
                f"images to {os.path.join(root, split_folder)}/ (and the validation split's to instances_val2017.json "
                f"and val2017/).")
    return (f"download COCO 2017 with `python -m jaxrat.data.download coco2017 --dest {root}`, put your own "
            f"COCO-format file there with its images in {os.path.join(root, split_folder)}/, or fix "
            f"--config.data.data_dir.")


# What each entry of a COCO instances file needs, by list (pycocotools and the records read them).
REQUIRED = {"images": ("id", "file_name", "width", "height"),
            "annotations": ("id", "image_id", "category_id", "bbox"),
            "categories": ("id", "name")}


def _check_instances(spec: Any, path: str) -> None:
    """Refuse a JSON that is not a COCO instances file (a list, another tool's format) or whose entries
    lack what COCO's have, naming the first such entry; refuse annotations that name an image or a
    category the file does not list (they would be dropped without a word)."""
    what = f"COCO annotation file {path}"
    if not isinstance(spec, dict):  # pycocotools' own assertion, and what it means
        raise DataError(f"{what} is not valid (AssertionError: annotation file format {type(spec)} not supported): "
                        f"a COCO instances file is an object with images, annotations and categories; convert it to "
                        f"COCO format.")
    if not any(k in spec for k in REQUIRED):  # another tool's format (labelme, VOC as JSON, ...)
        raise DataError(f"{what} is not a COCO instances file: it has no {', '.join(map(repr, REQUIRED))} (its "
                        f"keys are {', '.join(map(str, list(spec)[:8]))}); convert it to COCO format.")
    for key, fields in REQUIRED.items():
        for i, entry in enumerate(spec.get(key) or []):
            lacks = [f for f in fields if f not in entry] if isinstance(entry, dict) else list(fields)
            if lacks:
                raise DataError(f"{what} is not valid at {_entry(key, i, entry)} {lacks[0]!r}; fix it (COCO's "
                                f"{key} have {', '.join(fields)}).")
    images = {im["id"] for im in spec.get("images") or []}
    categories = {c["id"] for c in spec.get("categories") or []}
    for ann in spec.get("annotations") or []:
        if "categories" in spec and ann["category_id"] not in categories:
            raise DataError(f"{path}: annotation {ann['id']} (image {ann['image_id']}) has category_id "
                            f"{ann['category_id']}, which its categories do not list ("
                            f"{', '.join(map(str, sorted(categories)[:10]))}); add it to categories or fix the "
                            f"annotation.")
        if "images" in spec and ann["image_id"] not in images:
            raise DataError(f"{path}: annotation {ann['id']} has image_id {ann['image_id']}, which its images do not "
                            f"list; add the image or remove the annotation.")


def _entry(key: str, index: int, entry: Any) -> str:
    """Where an entry is, for a message ending in the field it lacks: by image id where it has one."""
    if isinstance(entry, dict) and key == "images" and "id" in entry:
        return f"image id {entry['id']}: it has no"
    if isinstance(entry, dict) and key == "annotations" and "image_id" in entry:
        return f"image id {entry['image_id']}: annotation {entry.get('id', f'#{index}')} has no"
    return f"{key}[{index}]: it has no"


@dataclasses.dataclass(frozen=True)
class DecodeCoco(grain.transforms.Map):
    """Record -> {"image", "boxes" (normalised xyxy), "labels", "is_crowd", "area", "image_id"}."""

    include_crowd: bool = False
    at_least: tuple[int, int] | None = None

    def map(self, rec: dict[str, Any]) -> T.Example:
        image, (w, h) = load_rgb_with_size(rec["path"], self.at_least)
        if (w, h) != (rec["width"], rec["height"]):
            # Images are read upright (EXIF applied): annotations made on the sideways pixels are turned.
            turned = (" (they describe it as stored, before its EXIF orientation turns it)"
                      if (h, w) == (rec["width"], rec["height"]) and exif_orientation(rec["path"]) >= 5 else "")
            raise BadFileError(rec["path"], f"image is {w}x{h} but its annotations say {rec['width']}x{rec['height']}"
                                            f"{turned}", "correct its width and height in the annotation file (or "
                                            "replace the image), or set --config.data.on_bad_file=skip")
        keep = np.ones(len(rec["labels"]), bool) if self.include_crowd else rec["is_crowd"] == 0
        return {
            "image": image,
            "boxes": rec["boxes"][keep],
            "labels": rec["labels"][keep],
            "is_crowd": rec["is_crowd"][keep],
            "area": rec["area"][keep],
            "image_id": np.int64(rec["image_id"]),
        }


class CocoDetection:
    """One split of COCO: ``records`` (random access, one per image), ``loader`` and the label map.

    ``skip_empty`` leaves out images without a non-crowd object (for training). Image files that
    are missing or empty are handled by ``policy`` before training; undecodable ones when read.
    ``categories``: the training split, whose categories are the labels of this one (a model has one
    label space; a validation file may list fewer categories, or list them in another order).
    """

    def __init__(self, root: str, split: str, *, policy: BadFilePolicy | None = None, skip_empty: bool = False,
                 include_crowd: bool = False, categories: CocoDetection | None = None):
        if split not in SPLITS:
            raise DataError(f"Unknown COCO split {split!r}; use 'train' or 'validation'.")
        self.policy = policy or BadFilePolicy()
        self.annotation_file = annotation_file(root, split)
        self.coco = load_annotations(self.annotation_file)
        image_dir = os.path.join(root, SPLITS[split])
        if not os.path.isdir(image_dir):
            raise DataError(f"COCO image folder {image_dir} not found; download COCO 2017 "
                            "or fix --config.data.data_dir.")
        where = "its categories"
        try:
            self.category_ids: list[int] = sorted(self.coco.getCatIds())
            self.class_names: list[str] = [self.coco.cats[c]["name"] for c in self.category_ids]
            if categories is not None:
                self._take_categories(categories)
            to_label = {c: i for i, c in enumerate(self.category_ids)}
            self.records: list[dict[str, Any]] = []
            dropped: list[str] = []
            for image_id in sorted(self.coco.getImgIds()):
                where = f"image id {image_id}"
                info = self.coco.imgs[image_id]
                rec = _record(self.coco, info, image_dir, to_label, dropped)
                if skip_empty and not (rec["is_crowd"] == 0).any():
                    continue
                if self._usable(rec["path"]):
                    self.records.append(rec)
        except (KeyError, TypeError, ValueError, IndexError) as e:
            # A hand-edited or truncated-then-repaired file: a field missing or of the wrong type.
            raise DataError(f"COCO annotation file {self.annotation_file} is not valid at {where} "
                            f"({type(e).__name__}: {e}); fix or re-download it.") from None
        if dropped:
            logging.warning("data: %d of %d boxes in %s have no area inside their image (outside it, or a width or "
                            "height <= 0) and are left out; first: %s.", len(dropped), len(self.coco.anns),
                            self.annotation_file, dropped[0])
        if not self.records:
            raise DataError(f"No usable COCO images in {image_dir} for {self.annotation_file}; fix the dataset.")
        self.loader = DecodeCoco(include_crowd=include_crowd)

    def _take_categories(self, train: CocoDetection) -> None:
        """Label this split with ``train``'s categories; one of its own that training lacks cannot be learned."""
        unknown = [c for c in self.category_ids if c not in train.category_ids]
        if unknown:
            c = unknown[0]
            raise DataError(f"Category {c} ({self.coco.cats[c]['name']!r}) of {self.annotation_file} is not among the "
                            f"categories of {train.annotation_file}, so it cannot be learned; add it (and its training "
                            f"boxes) there, or remove it from this file.")
        self.category_ids, self.class_names = list(train.category_ids), list(train.class_names)

    def _usable(self, path: str) -> bool:
        # Existence and size only: opening 118k headers would cost more than it finds.
        problem = None if os.path.isfile(path) else "file not found"
        if problem is None and os.path.getsize(path) == 0:
            problem = "file is empty"
        if problem:
            self.policy.handle(BadFileError(path, problem))
            return False
        return True

    def __len__(self) -> int:
        return len(self.records)

    @property
    def num_classes(self) -> int:
        return len(self.category_ids)

    def example_source(self, name: str = "coco2017") -> ExampleSource:
        """This split as pipeline records (records + loader + policy) for ``pipeline.train_iterator``."""
        return ExampleSource(self.records, loader=self.loader, policy=self.policy, name=name)


def _record(coco, info: dict, image_dir: str, to_label: dict[int, int], dropped: list[str]) -> dict[str, Any]:
    """One image's record; boxes with no area inside the image are left out and described in ``dropped``."""
    w, h = float(info["width"]), float(info["height"])
    boxes, labels, crowd, area = [], [], [], []
    for ann in coco.imgToAnns.get(info["id"], []):
        x, y, bw, bh = ann["bbox"]
        x1, y1, x2, y2 = max(0.0, x), max(0.0, y), min(w, x + bw), min(h, y + bh)
        if x2 <= x1 or y2 <= y1:
            # Degenerate or outside the image: nothing to learn (counted, so a file of such boxes is seen).
            dropped.append(f"annotation {ann['id']} (image {info['id']}, {info['width']}x{info['height']}) "
                           f"bbox {list(ann['bbox'])}")
            continue
        boxes.append([x1 / w, y1 / h, x2 / w, y2 / h])
        labels.append(to_label[ann["category_id"]])
        crowd.append(int(ann.get("iscrowd", 0)))
        area.append(float(ann.get("area", bw * bh)))
    return {
        "path": os.path.join(image_dir, info["file_name"]),
        "image_id": int(info["id"]),
        "width": int(info["width"]),
        "height": int(info["height"]),
        "boxes": np.asarray(boxes, np.float32).reshape(-1, 4),
        "labels": np.asarray(labels, np.int32),
        "is_crowd": np.asarray(crowd, np.int32),
        "area": np.asarray(area, np.float32),
    }


def detection_ops(
    image_size: int, *, train: bool, max_boxes: int = 100, random_flip: bool = True,
    scale_jitter: Sequence[float] = (1.0, 1.0), color_jitter: float = 0.0,
) -> list:
    """Box-aware ops: resize keeping the aspect (zero padding), optional scale jitter, left-right
    flip, colour jitter, normalisation and fixed-size box arrays with ``box_valid``."""
    ops: list = [T.Resize(image_size, keep_aspect=True)]
    if train and tuple(scale_jitter) != (1.0, 1.0):
        ops = [T.ScaleJitter(image_size, scale=tuple(float(s) for s in scale_jitter))]
    if train and random_flip:
        ops.append(T.RandomFlip(horizontal=0.5, vertical=0.0))  # scenes have an up; objects are not mirrored vertically
    if train and color_jitter:
        ops.append(T.ColorJitter(color_jitter, color_jitter, color_jitter, color_jitter / 2))
    ops += [T.Normalize(), PadBoxes(max_boxes)]
    return ops


@dataclasses.dataclass(frozen=True)
class PadBoxes(grain.transforms.Map):
    """Fixed ``max_boxes`` per image so examples batch; ``box_valid`` marks real boxes."""

    max_boxes: int = 100

    def map(self, ex: T.Example) -> T.Example:
        return T.pad_boxes(ex, self.max_boxes)
