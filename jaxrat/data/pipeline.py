"""Grain pipelines for segmentation: per-host, deterministic, resumable from the step.

The training stream is one global sequence: shuffle (reshuffled each epoch) -> repeat ->
random augmentation seeded by the element's *global* index. Host ``p`` of ``P`` reads elements
``p, p+P, p+2P, ...`` so the global batch of step ``s`` is always global elements
``[s*B, (s+1)*B)`` whatever the number of hosts: a run resumed on another process count sees
exactly the examples an uninterrupted run would have seen.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, Sequence

import grain
import numpy as np
from PIL import Image

from jaxrat.data.imageio import load_mask, load_rgb
from jaxrat.errors import DataError

IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], np.float32) * 255
IMAGENET_STD = np.array([0.229, 0.224, 0.225], np.float32) * 255


@dataclasses.dataclass(frozen=True)
class PairSource:
    """Random-access source of (image path, mask path) pairs."""

    pairs: Sequence[tuple[str, str]]

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: int) -> tuple[str, str]:
        return self.pairs[index]


@dataclasses.dataclass(frozen=True)
class LoadResize(grain.transforms.Map):
    """Decode an (image, mask) pair and resize both to ``size`` x ``size``."""

    size: int

    def map(self, pair: tuple[str, str]) -> dict[str, np.ndarray]:
        img_path, mask_path = pair
        image, mask = load_rgb(img_path), load_mask(mask_path)
        if image.shape[:2] != mask.shape:
            raise DataError(
                f"Mask {mask_path} is {mask.shape[1]}x{mask.shape[0]} but image {img_path} is "
                f"{image.shape[1]}x{image.shape[0]}; the mask must match its image."
            )
        image = np.asarray(Image.fromarray(image).resize((self.size, self.size), Image.BILINEAR))
        mask = np.asarray(Image.fromarray(mask).resize((self.size, self.size), Image.NEAREST))
        return {"image": image, "mask": mask}


@dataclasses.dataclass(frozen=True)
class RandomFlip(grain.transforms.RandomMap):
    """Horizontal and vertical flips, each with probability 1/2 (lesions have no orientation)."""

    def random_map(self, ex: dict[str, np.ndarray], rng: np.random.Generator) -> dict[str, np.ndarray]:
        for axis in (0, 1):
            if rng.random() < 0.5:
                ex = {k: np.flip(v, axis=axis) for k, v in ex.items()}
        return ex


def normalize(ex: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """uint8 image -> ImageNet-normalised float32; {0,1} mask -> float32 (H, W, 1)."""
    image = (ex["image"].astype(np.float32) - IMAGENET_MEAN) / IMAGENET_STD
    out = {"image": image, "mask": ex["mask"].astype(np.float32)[..., None]}
    if "valid" in ex:
        out["valid"] = ex["valid"]
    return out


def _read_options(num_threads: int, prefetch: int) -> grain.ReadOptions:
    return grain.ReadOptions(num_threads=max(num_threads, 0), prefetch_buffer_size=max(prefetch, 0))


def train_iterator(
    pairs: Sequence[tuple[str, str]],
    *,
    image_size: int,
    local_batch: int,
    seed: int,
    process_index: int,
    process_count: int,
    start_example: int = 0,
    random_flip: bool = True,
    num_threads: int = 2,
    prefetch: int = 4,
) -> grain.DatasetIterator:
    """Infinite iterator of this host's training batches, starting at global element ``start_example``.

    ``start_example`` must be a multiple of the global batch (``local_batch * process_count``).
    """
    ds = grain.MapDataset.source(PairSource(pairs)).seed(seed).shuffle().repeat(None)
    ds = ds.map(LoadResize(image_size))
    if random_flip:
        ds = ds.random_map(RandomFlip())
    ds = ds.map(normalize)
    ds = ds[start_example + process_index :: process_count]
    it = ds.to_iter_dataset(_read_options(num_threads, prefetch)).batch(local_batch, drop_remainder=True)
    return iter(it)


def eval_batches(
    pairs: Sequence[tuple[str, str]],
    *,
    image_size: int,
    global_batch: int,
    process_index: int,
    process_count: int,
    num_threads: int = 2,
) -> Iterator[dict[str, np.ndarray]]:
    """This host's eval batches; the set is padded to whole global batches and ``valid`` marks real
    examples, so every host runs the same number of eval steps and padding never counts."""
    n = len(pairs)
    padded = -(-n // global_batch) * global_batch
    ds = grain.MapDataset.range(padded)

    load = LoadResize(image_size)

    def fetch(i: int) -> dict[str, np.ndarray]:
        ex = load.map(pairs[min(i, n - 1)])
        ex["valid"] = np.float32(i < n)
        return normalize(ex)

    ds = ds[process_index::process_count].map(fetch)
    local_batch = global_batch // process_count
    it = ds.to_iter_dataset(_read_options(num_threads, 2)).batch(local_batch, drop_remainder=True)
    return iter(it)
