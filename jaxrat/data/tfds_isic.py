"""TFDS without TensorFlow: an ISIC 2018 builder writing ArrayRecord, and readers for any TFDS
dataset prepared as ArrayRecord (``tfds.data_source``; ``tfds.load`` would need TensorFlow).

Convert the official folders once (the JPEG/PNG bytes are stored as they are, not re-encoded):

    python -m jaxrat.data.tfds_isic --src ISIC_DIR --out TFDS_DIR [--split-file F] [--on-bad-file skip]

then train with ``--config.data.source=tfds --config.data.data_dir=TFDS_DIR``. Reading a few
large ArrayRecord files instead of thousands of small images is kinder to shared filesystems.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import os
import sys
from typing import Any, Sequence

import grain
import numpy as np

from jaxrat.data import isic
from jaxrat.data.badfiles import BadFilePolicy
from jaxrat.errors import DataError, UserError

NAME = "isic2018_task1"


@functools.cache
def _builder_class():
    """Defined lazily (importing tensorflow_datasets costs about a second) and once (tfds
    registers builder classes by name)."""
    import tensorflow_datasets as tfds

    class Isic2018Task1(tfds.core.GeneratorBasedBuilder):
        """ISIC 2018 Task 1 lesion segmentation, from the official folders (manual_dir)."""

        VERSION = tfds.core.Version("1.0.0")
        MANUAL_DOWNLOAD_INSTRUCTIONS = "Run `python -m jaxrat.data.download isic2018 --dest DIR` and pass DIR."
        split_file = ""
        on_bad_file = "fail"

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
            policy = BadFilePolicy(self.on_bad_file)
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
            for img, mask in pairs:
                image_id = os.path.splitext(os.path.basename(img))[0]
                # File paths: tfds stores the bytes as they are (encoding arrays would need TF).
                yield image_id, {"image": img, "mask": mask, "image_id": image_id}

    assert Isic2018Task1.name == NAME
    return Isic2018Task1


def prepare(src: str, out: str, *, split_file: str = "", on_bad_file: str = "fail") -> str:
    """Convert the official ISIC folders under ``src`` to ArrayRecord under ``out``; returns ``out``."""
    cls = _builder_class()
    cls.split_file, cls.on_bad_file = split_file, on_bad_file
    builder = cls(data_dir=out, file_format="array_record")
    import tensorflow_datasets as tfds

    builder.download_and_prepare(download_config=tfds.download.DownloadConfig(manual_dir=src))
    return out


def data_source(name: str, split: str, data_dir: str):
    """``tfds.data_source`` with a clear error when the dataset was not prepared as ArrayRecord."""
    import tensorflow_datasets as tfds

    if name == NAME:
        _builder_class()  # registers the builder so tfds can read its metadata
    try:
        return tfds.data_source(name, split=split, data_dir=data_dir)
    except (ValueError, KeyError, OSError, AssertionError, tfds.core.registered.DatasetNotFoundError) as e:
        raise DataError(
            f"TFDS dataset {name!r} split {split!r} is not prepared as ArrayRecord in {data_dir} "
            f"({type(e).__name__}); prepare it (ISIC: `python -m jaxrat.data.tfds_isic --src DIR --out {data_dir}`)."
        ) from None


@dataclasses.dataclass(frozen=True)
class FromTfds(grain.transforms.Map):
    """A TFDS record -> {"image", "mask"} and/or {"labels"}; masks become {0, 1}."""

    image_key: str = "image"
    mask_key: str | None = "mask"
    label_keys: tuple[str, ...] = ()

    def map(self, rec: dict[str, Any]) -> dict[str, np.ndarray]:
        image = np.asarray(rec[self.image_key])
        if image.ndim == 2 or image.shape[-1] == 1:
            image = np.repeat(image.reshape(*image.shape[:2], 1), 3, axis=-1)
        out = {"image": image.astype(np.uint8)}
        if self.mask_key:
            m = np.asarray(rec[self.mask_key])
            out["mask"] = (m.reshape(m.shape[:2]) > 127).astype(np.uint8)
        if self.label_keys:
            out["labels"] = np.array([int(rec[k]) for k in self.label_keys], np.int32)
        return out


def tfds_data(name: str, split: str, data_dir: str, *, image_key: str = "image", mask_key: str | None = None,
              label_keys: Sequence[str] = ("label",), policy: BadFilePolicy | None = None):
    """Any ArrayRecord TFDS dataset as pipeline data (classification by default)."""
    from jaxrat.data.pipeline import SegmentationData

    src = data_source(name, split, data_dir)
    loader = FromTfds(image_key, mask_key, tuple(label_keys) if mask_key is None else ())
    return SegmentationData(src, loader=loader, policy=policy or BadFilePolicy(), name=f"{name}/{split}")


def segmentation_data(data_dir: str, split: str, policy: BadFilePolicy, split_file: str = ""):
    """The ISIC ArrayRecord made by :func:`prepare` as pipeline data."""
    if split_file:
        raise DataError("config.data.split_file applies when converting: pass --split-file to "
                        "`python -m jaxrat.data.tfds_isic` and leave config.data.split_file empty.")
    from jaxrat.data.pipeline import SegmentationData

    src = data_source(NAME, split, data_dir)
    return SegmentationData(src, loader=FromTfds("image", "mask"), policy=policy, name=f"{NAME}/{split}")


def main(argv: list[str] | None = None) -> int:
    """``python -m jaxrat.data.tfds_isic --src DIR --out DIR``; user errors print one sentence, exit 2."""
    p = argparse.ArgumentParser(prog="python -m jaxrat.data.tfds_isic", description="Convert ISIC 2018 to ArrayRecord.")
    p.add_argument("--src", required=True, help="folder with the official ISIC 2018 folders")
    p.add_argument("--out", required=True, help="TFDS data_dir to write (config.data.data_dir with source=tfds)")
    p.add_argument("--split-file", default="")
    p.add_argument("--on-bad-file", default="fail", choices=("fail", "skip"))
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        prepare(args.src, args.out, split_file=args.split_file, on_bad_file=args.on_bad_file)
    except UserError as e:
        print(f"jaxrat: error: {e}", file=sys.stderr)
        return 2
    print(f"{NAME} written as ArrayRecord under {os.path.abspath(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
