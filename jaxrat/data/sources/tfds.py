"""Any TFDS dataset prepared as ArrayRecord, read through ``tfds.data_source`` (no TensorFlow;
``tfds.load`` and TFDS's own COCO builder would need it).

    example_source("my_dataset", "train", DATA_DIR, image_key="image", label_keys=("label",))

gives pipeline records (classification by default; ``mask_key`` for segmentation).
"""

from __future__ import annotations

import dataclasses
import glob
import os
from typing import Any, Sequence

import grain
import numpy as np

from jaxrat.data.badfiles import BadFilePolicy
from jaxrat.data.imageio import binary_mask
from jaxrat.data.pipeline import ExampleSource
from jaxrat.runtime import folders
from jaxrat.runtime.errors import DataError


def data_source(name: str, split: str, data_dir: str, *, encoded: Sequence[str] = (), how_to_prepare: str = ""):
    """``tfds.data_source`` with a clear error when the dataset was not prepared as ArrayRecord;
    the features named in ``encoded`` come back as their stored bytes, undecoded.
    ``how_to_prepare`` is the command the error suggests (a dataset's own converter)."""
    import tensorflow_datasets as tfds

    decoders = {k: tfds.decode.SkipDecoding() for k in encoded} or None
    hint = f" ({how_to_prepare})" if how_to_prepare else ""
    not_prepared = (f"TFDS dataset {name!r} split {split!r} is not prepared as ArrayRecord in {data_dir} ({{}}); "
                    f"prepare it{hint} or fix --config.data.data_dir.")
    if data_dir and not folders.glob_files(os.path.join(glob.escape(data_dir), name.split(":")[0], "**",
                                                        "dataset_info.json")):
        # tfds would otherwise start preparing it there: a mistyped folder would be created, then fail.
        raise DataError(not_prepared.format("no dataset_info.json"))
    try:
        return tfds.data_source(name, split=split, data_dir=data_dir, decoders=decoders)
    except (ValueError, KeyError, OSError, AssertionError, tfds.core.registered.DatasetNotFoundError) as e:
        raise DataError(not_prepared.format(type(e).__name__)) from None


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
            out["mask"] = binary_mask(m.reshape(m.shape[:2]) if m.ndim == 3 and m.shape[-1] == 1 else m)
        if self.label_keys:
            out["labels"] = np.array([int(rec[k]) for k in self.label_keys], np.int32)
        return out


def example_source(name: str, split: str, data_dir: str, *, image_key: str = "image", mask_key: str | None = None,
                   label_keys: Sequence[str] = ("label",), policy: BadFilePolicy | None = None) -> ExampleSource:
    """One split of an ArrayRecord TFDS dataset as pipeline records (classification by default)."""
    src = data_source(name, split, data_dir)
    loader = FromTfds(image_key, mask_key, tuple(label_keys) if mask_key is None else ())
    return ExampleSource(src, loader=loader, policy=policy or BadFilePolicy(), name=f"{name}/{split}")
