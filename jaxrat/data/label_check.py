"""Label sanity of a segmentation dataset, checked before training so unusable masks never train silently.

Class maps (``model.num_classes > 1``): a split whose every pixel is 255 (ignore) trains to loss 0 and
scores Dice 1.0; ISIC-style 0/255 masks (or 1-bit masks, read as 0/255) have all their foreground
ignored. Both are refused in one sentence naming the fix; more than half the pixels ignored is
warned about with the count. Binary masks (``model.num_classes == 1``, foreground above 127, or 1 in
0/1 masks): a mask of small values that are not 0/1 (a class map 0/1/2, or 0/1 saved as JPEG, whose
compression adds 2s and 3s) would read as all background, and a training split without any
foreground pixel has nothing to learn; both are refused.

Like nnU-Net's dataset fingerprint, the check works on per-mask value histograms read once and
kept in ``WORKDIR/label_stats.json``, keyed by each mask's path, size and mtime (a changed mask is
read again, a resumed run reads none). It stays cheap on large datasets: an even sample of
:data:`SAMPLE` masks per split, and the rest only while the sample looks unusable, so a refusal is
made on every mask and a usable dataset costs the sample.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Sequence

import numpy as np

from jaxrat.data.imageio import BadFileError, binary_threshold, mask_levels
from jaxrat.data.sources.segmentation_folder import IGNORE_INDEX, load_stored
from jaxrat.runtime.errors import DataError
from jaxrat.runtime.fileio import write_json

LABEL_STATS_NAME = "label_stats.json"
SAMPLE = 64  # masks read per split when they look fine
WARN_IGNORED = 0.5  # share of ignored pixels that earns a warning


class HistogramCache:
    """Stored-value histograms of masks by path, valid while the file's size and mtime are unchanged;
    ``binary``: histograms of the levels a binary run thresholds (:func:`jaxrat.data.imageio.mask_levels`)."""

    def __init__(self, path: str | None, binary: bool = False):
        self.path, self.entries, self.dirty = path, {}, False
        self.kind, self.read = ("levels", mask_levels) if binary else ("stored", load_stored)
        if path:
            try:
                with open(path) as f:
                    self.entries = json.load(f).get("masks", {})
            except (OSError, ValueError, AttributeError):
                self.entries = {}  # missing or damaged: the masks are read again

    def histogram(self, mask: str) -> np.ndarray:
        """Counts of the 256 stored values of ``mask``; raises BadFileError for an unreadable one."""
        st = os.stat(mask)
        key = os.path.abspath(mask)
        entry = self.entries.get(key)
        if (isinstance(entry, dict) and entry.get("stat") == [st.st_size, st.st_mtime_ns]
                and entry.get("kind", "stored") == self.kind):
            hist = np.zeros(256, np.int64)
            for value, count in entry.get("counts", {}).items():
                hist[int(value)] = int(count)
            return hist
        hist = np.bincount(self.read(mask).ravel(), minlength=256).astype(np.int64)
        self.entries[key] = {"stat": [st.st_size, st.st_mtime_ns], "kind": self.kind,
                             "counts": {str(v): int(hist[v]) for v in np.flatnonzero(hist)}}
        self.dirty = True
        return hist

    def save(self) -> None:
        """Write the cache if anything was read; a workdir that cannot be written only costs the cache."""
        if self.path and self.dirty:
            try:
                os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
                write_json(self.path, {"masks": self.entries})
                self.dirty = False
            except OSError as e:
                logging.info("data: label statistics not cached in %s (%s)", self.path, e)


def _sample_order(masks: Sequence[str]) -> tuple[list[str], list[str]]:
    """An even spread of at most SAMPLE masks, then the others."""
    ordered = sorted(masks)
    if len(ordered) <= SAMPLE:
        return ordered, []
    picks = sorted(set(np.linspace(0, len(ordered) - 1, SAMPLE).round().astype(int).tolist()))
    chosen = set(picks)
    return [ordered[i] for i in picks], [m for i, m in enumerate(ordered) if i not in chosen]


def check_split(pairs: Sequence[tuple[str, str]], split: str, num_classes: int, table: np.ndarray | None,
                cache: HistogramCache) -> None:
    """Refuse a split of (image, mask) pairs whose labels cannot train ``num_classes`` classes; warn
    when more than half of its pixels are ignored. ``table``: the ``data.label_map`` lookup, or None."""
    if num_classes < 2 or not pairs:
        return  # binary masks are thresholded and have no ignore value
    lookup = table if table is not None else np.arange(256, dtype=np.uint8)
    ignored_value = lookup == IGNORE_INDEX
    sample, rest = _sample_order([m for _, m in pairs])
    stored = np.zeros(256, np.int64)
    read = 0

    def labelled() -> int:
        return int(stored[~ignored_value].sum())

    def only_zero_and_ignored_255() -> bool:
        values = set(np.flatnonzero(stored).tolist())
        return values == {0, 255} and bool(ignored_value[255]) and not ignored_value[0]

    for i, mask in enumerate(sample + rest):
        # The sample decides unless it looks unusable; then every mask is read before refusing.
        if i >= len(sample) and labelled() and not only_zero_and_ignored_255():
            break
        try:
            stored += cache.histogram(mask)
            read += 1
        except (BadFileError, OSError):
            continue  # the bad-file policy meets it when the pipeline reads the pair
    cache.save()
    if not read:
        return
    total = int(stored.sum())
    where = f"the {read} mask(s) of the {split} split"
    mapped = " after --config.data.label_map" if table is not None else ""
    if not labelled():
        raise DataError(f"Every pixel of {where} is {IGNORE_INDEX} (ignore){mapped}, so there is nothing to learn "
                        f"or score; fix the masks ({IGNORE_INDEX} marks pixels to ignore), or map their values to "
                        f"classes with --config.data.label_map.")
    if only_zero_and_ignored_255():
        raise DataError(f"The masks of the {split} split hold only 0 and 255 ({read} read; 1-bit masks read so too), "
                        f"and 255 means ignore, so with model.num_classes={num_classes} every foreground pixel would "
                        f"be ignored; for binary masks set --config.model.num_classes=1, or map 255 to class 1 with "
                        f"--config.data.label_map='((0, 0), (255, 1))'.")
    ignored = total - labelled()
    if ignored > WARN_IGNORED * total:
        logging.warning("data: %d of %d pixels (%.0f%%) in %s are %d (ignore)%s and do not train; check the masks "
                        "or --config.data.label_map.", ignored, total, 100 * ignored / total, where, IGNORE_INDEX,
                        mapped)


def check_binary_split(pairs: Sequence[tuple[str, str]], split: str, cache: HistogramCache) -> None:
    """Refuse a split of binary (image, mask) pairs with a mask of small values other than 0/1, which
    would read as all background, or, for a training split, without any foreground pixel; warn when a
    validation split has none (its scores then only rate empty predictions). ``cache``: binary."""
    if not pairs:
        return
    sample, rest = _sample_order([m for _, m in pairs])
    foreground = read = 0
    try:
        for i, mask in enumerate(sample + rest):
            if i >= len(sample) and foreground:
                break  # the sample decides unless it holds no foreground at all
            try:
                hist = cache.histogram(mask)
            except (BadFileError, OSError):
                continue  # the bad-file policy meets it when the pipeline reads the pair
            read += 1
            levels = np.flatnonzero(hist)
            top = int(levels.max(initial=0))
            if 1 < top <= 127:
                raise DataError(
                    f"{mask} holds the values {levels[:8].tolist()}, none above 127, which a binary run "
                    f"(model.num_classes=1) reads as all background; for class maps set --config.model.num_classes "
                    f"to the number of classes, and save binary masks as 0/255, or as 0/1 in PNG (JPEG compression "
                    f"turns 0/1 into 0-3).")
            foreground += int(hist[binary_threshold(top) + 1:].sum())
    finally:
        cache.save()
    if not read or foreground:
        return
    what = (f"No mask of the {split} split ({read} read) has a foreground pixel (a level above 127, or 1 in 0/1 "
            f"masks)")
    if split.startswith("train"):
        raise DataError(f"{what}, so there is nothing to learn; check the masks folder "
                        f"(--config.data.masks_folder) and that the lesions are drawn in white (or 1) on black.")
    logging.warning("data: %s; its Dice and IoU only score empty predictions.", what)
