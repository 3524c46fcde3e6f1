"""ISIC 2018 Task 1 as ArrayRecord: a TFDS builder (no TensorFlow: ``file_format='array_record'``)
that converts the official folders once, and the reader of what it wrote.

The JPEG/PNG bytes are stored as they are, or with ``max_side`` shrunk to that longer side and
re-encoded, which makes big photos much cheaper to decode every epoch. The command line is
``python -m jaxrat.data.prepare_isic``; training reads the result with
``--config.data.source=tfds --config.data.data_dir=OUT``. A few large ArrayRecord files instead
of thousands of small images are kinder to shared filesystems.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import os
from typing import Any

import grain
import numpy as np
from PIL import Image

from jaxrat.data.badfiles import SKIPPED_FILES_NAME, BadFilePolicy
from jaxrat.data.imageio import BadFileError, Encoded, load_mask, load_rgb_with_size
from jaxrat.data.pipeline import ExampleSource
from jaxrat.data.sources import isic
from jaxrat.data.sources.isic import DecodePair
from jaxrat.data.sources.tfds import data_source
from jaxrat.runtime.errors import DataError
from jaxrat.runtime.fileio import write_json

NAME = "isic2018_task1"
CLI = "python -m jaxrat.data.prepare_isic"


@functools.cache
def builder_class():
    """The builder, defined (and so registered with tfds, which reading the dataset's metadata
    needs) on first use: importing tensorflow_datasets costs about a second, and once, because
    tfds registers builder classes by name."""
    import tensorflow_datasets as tfds

    class Isic2018Task1(tfds.core.GeneratorBasedBuilder):
        """ISIC 2018 Task 1 lesion segmentation, from the official folders (manual_dir)."""

        VERSION = tfds.core.Version("1.0.0")
        MANUAL_DOWNLOAD_INSTRUCTIONS = "Run `python -m jaxrat.data.download isic2018 --dest DIR` and pass DIR."
        split_file = ""
        on_bad_file = "fail"
        skipped_files = None  # where "skip" lists the files left out (OUT/skipped_files.txt)
        max_side = 0

        def _info(self):
            return self.dataset_info_from_configs(
                features=tfds.features.FeaturesDict({
                    "image": tfds.features.Image(shape=(None, None, 3)),
                    "mask": tfds.features.Image(shape=(None, None, 1)),
                    "image_id": tfds.features.Text(),
                }),
                description="ISIC 2018 Task 1 images and 0/255 lesion masks.",
            )

        def _split_generators(self, dl_manager):
            src = str(dl_manager.manual_dir)
            policy = BadFilePolicy(self.on_bad_file, self.skipped_files)
            splits = {}
            for split, (img_folder, _) in isic.SPLIT_FOLDERS.items():
                if self.split_file or os.path.isdir(os.path.join(src, img_folder)):
                    try:
                        pairs = isic.find_pairs(src, split, split_file=self.split_file, policy=policy)
                    except DataError:
                        if split == "train":
                            raise
                        continue  # validation/test may be absent
                    splits[split] = self._generate_examples(pairs)
            return splits

        def _generate_examples(self, pairs):
            max_side, policy = self.max_side, BadFilePolicy(self.on_bad_file, self.skipped_files)
            for img, mask in pairs:
                image_id = os.path.splitext(os.path.basename(img))[0]
                if max_side:
                    try:
                        img, mask = shrink_pair(img, mask, max_side)
                    except BadFileError as e:
                        policy.handle(e)  # raises under "fail"
                        continue
                # Paths or encoded bytes: tfds stores them as they are (encoding arrays would need TF).
                yield image_id, {"image": img, "mask": mask, "image_id": image_id}

    assert Isic2018Task1.name == NAME
    return Isic2018Task1


def shrink_pair(image_path: str, mask_path: str, max_side: int) -> tuple[bytes, bytes]:
    """The image (JPEG, quality 95, 4:4:4) and mask (PNG, 0/255) with the longer side at most ``max_side``.

    Many ISIC photos are 10-30 megapixels, and decoding them costs far more than everything else
    the pipeline does at 256 px; storing them at, say, 4x the training size once makes every epoch
    that much cheaper. Odd formats are converted to RGB on the way."""
    image, size = load_rgb_with_size(image_path, at_least=(max_side, max_side))
    mask = load_mask(mask_path)
    if mask.shape[::-1] != size:
        raise BadFileError(mask_path, f"mask is {mask.shape[1]}x{mask.shape[0]} but its image is {size[0]}x{size[1]}")
    scale = min(1.0, max_side / max(size))
    w, h = max(1, round(size[0] * scale)), max(1, round(size[1] * scale))
    pil_image = Image.fromarray(image)
    if pil_image.size != (w, h):
        pil_image = pil_image.resize((w, h), Image.LANCZOS)
    pil_mask = Image.fromarray(mask * np.uint8(255))
    if pil_mask.size != (w, h):
        pil_mask = pil_mask.resize((w, h), Image.NEAREST)
    ib, mb = io.BytesIO(), io.BytesIO()
    pil_image.save(ib, format="JPEG", quality=95, subsampling=0)  # full-resolution colour: lesion borders
    pil_mask.save(mb, format="PNG")
    return ib.getvalue(), mb.getvalue()


_SETTINGS_FILE = "jaxrat_prepare.json"


def prepare(src: str, out: str, *, split_file: str = "", on_bad_file: str = "fail", max_side: int = 0) -> str:
    """Convert the official ISIC folders under ``src`` to ArrayRecord under ``out``; returns ``out``.

    ``max_side > 0`` stores every image and mask shrunk to that longer side (see :func:`shrink_pair`);
    0 keeps the original bytes. ``out`` remembers the setting: preparing it again with another one
    is refused rather than silently keeping the first."""
    if max_side < 0:
        raise DataError(f"--max-side={max_side}; use 0 (keep the original size) or a number of pixels.")
    if os.path.commonpath([os.path.abspath(src), os.path.abspath(out)]) == os.path.abspath(src):
        raise DataError(f"--out {out} is inside --src {src}, and a dataset folder is only ever read; "
                        f"pick an --out outside it.")
    settings = {"max_side": int(max_side), "split_file": split_file}
    settings_path = os.path.join(out, _SETTINGS_FILE)
    if os.path.exists(settings_path):
        with open(settings_path) as f:
            before = json.load(f)
        if before != settings:
            raise DataError(f"{out} was prepared with {before}, not {settings}; pass another --out "
                            "(or delete that one) to prepare with these settings.")
    if not any(os.path.isdir(os.path.join(src, img_folder)) for img_folder, _ in isic.SPLIT_FOLDERS.values()):
        # tfds would only assert that its "manual_dir" is missing, with a traceback
        folder = os.path.join(src, isic.SPLIT_FOLDERS["train"][0])
        raise DataError(f"ISIC 2018 data not found: looked for {folder}; download it with "
                        f"`python -m jaxrat.data.download isic2018 --dest {src}` or fix --src.")
    cls = builder_class()
    cls.split_file, cls.on_bad_file, cls.max_side = split_file, on_bad_file, int(max_side)
    cls.skipped_files = os.path.join(out, SKIPPED_FILES_NAME)
    builder = cls(data_dir=out, file_format="array_record")
    import tensorflow_datasets as tfds

    builder.download_and_prepare(download_config=tfds.download.DownloadConfig(manual_dir=src))
    write_json(settings_path, settings)
    return out


@dataclasses.dataclass(frozen=True)
class DecodeRecord(grain.transforms.Map):
    """An ISIC record with the stored image and mask bytes -> {"image", "mask"}, decoded exactly
    as the files are (JPEG draft decoding down to ``at_least``, odd formats converted, sizes
    checked, broken bytes raised as BadFileError naming the record)."""

    where: str
    at_least: tuple[int, int] | None = None

    def map(self, rec: dict[str, Any]) -> dict[str, np.ndarray]:
        return DecodePair(self.at_least).map(self._pair(rec))

    def original_mask(self, rec: dict[str, Any]) -> np.ndarray:
        """The record's mask as stored, uint8 {0, 1} (for original-resolution metrics)."""
        return DecodePair().original_mask(self._pair(rec))

    def _pair(self, rec: dict[str, Any]) -> tuple[Encoded, Encoded]:
        image_id = rec["image_id"].decode() if isinstance(rec["image_id"], bytes) else str(rec["image_id"])
        name = f"{self.where}[{image_id}]"
        return Encoded(f"{name} image", rec["image"]), Encoded(f"{name} mask", rec["mask"])


def example_source(data_dir: str, split: str, policy: BadFilePolicy, split_file: str = "") -> ExampleSource:
    """One split of the ArrayRecord made by :func:`prepare` as pipeline records."""
    if split_file:
        raise DataError(f"config.data.split_file applies when converting: pass --split-file to `{CLI}` "
                        f"and leave config.data.split_file empty.")
    builder_class()
    # The bytes are decoded by DecodeRecord, not by tfds: it can decode big JPEGs at a reduced scale.
    src = data_source(NAME, split, data_dir, encoded=("image", "mask"),
                      how_to_prepare=f"`{CLI} --src ISIC_DIR --out {data_dir}`")
    where = f"{os.path.join(data_dir, NAME)}:{split}"
    return ExampleSource(src, loader=DecodeRecord(where), policy=policy, name=f"{NAME}/{split}")
