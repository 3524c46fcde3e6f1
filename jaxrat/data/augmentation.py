"""The augmentation op list of segmentation (and any task that reads images and masks): each
config switch adds exactly its op (:mod:`jaxrat.data.transforms`), training or evaluation."""

from __future__ import annotations

import math
from typing import Sequence

from jaxrat.data import transforms as T
from jaxrat.runtime.errors import ConfigError


def augment_ops(
    image_size: int,
    *,
    random_flip: bool = True,
    keep_aspect_ratio: bool = False,
    random_crop_scale: Sequence[float] = (1.0, 1.0),
    scale_jitter: Sequence[float] = (1.0, 1.0),
    rotation_degrees: float = 0.0,
    color_jitter: float = 0.0,
    elastic_prob: float = 0.0,
    elastic_alpha: float = 34.0,
    elastic_sigma: float = 4.0,
    train: bool = True,
) -> list:
    """The op list (after decoding) for segmentation; each switch adds exactly its op."""
    crop_lo, crop_hi = (float(x) for x in random_crop_scale)
    if not 0 < crop_lo <= crop_hi <= 1:
        raise ConfigError(f"config.data.random_crop_scale={tuple(random_crop_scale)}; "
                          "use (min, max) with 0 < min <= max <= 1.")
    if train and crop_lo < 1:
        # Letterbox first when asked: the crop alone would train on stretched images while
        # evaluation (Resize below) sees padded ones. Larger by the crop's zoom, to keep detail.
        canvas = int(math.ceil(image_size / math.sqrt(crop_lo)))
        ops: list = [T.Resize(canvas, keep_aspect=True)] if keep_aspect_ratio else []
        ops.append(T.RandomResizedCrop(image_size, scale=(crop_lo, crop_hi)))
    else:
        ops = [T.Resize(image_size, keep_aspect=keep_aspect_ratio)]
    if train:
        jit_lo, jit_hi = (float(x) for x in scale_jitter)
        if not 0 < jit_lo <= jit_hi:
            raise ConfigError(f"config.data.scale_jitter={tuple(scale_jitter)}; use (min, max) with 0 < min <= max.")
        if (jit_lo, jit_hi) != (1.0, 1.0):
            ops.append(T.ScaleJitter(image_size, scale=(jit_lo, jit_hi)))
        if random_flip:
            ops.append(T.RandomFlip())
        if rotation_degrees:
            ops.append(T.RandomRotation(float(rotation_degrees)))
        if elastic_prob:
            ops.append(T.ElasticDeform(alpha=float(elastic_alpha), sigma=float(elastic_sigma),
                                       prob=float(elastic_prob)))
        if color_jitter:
            x = float(color_jitter)
            ops.append(T.ColorJitter(brightness=x, contrast=x, saturation=x, hue=x / 2))
    ops.append(T.Normalize())
    return ops
