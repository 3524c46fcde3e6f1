"""``jaxrat.evaluate`` through the :class:`~jaxrat.inference.predictor.Predictor`: sliding-window
(``--tile``) segmentation scored at each image's own resolution, and ``--save-predictions``
(the files ``jaxrat.predict`` writes, for the evaluated split's images)."""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np

from jaxrat.inference.inputs import InputImage
from jaxrat.runtime.errors import ConfigError
from jaxrat.tasks import segmentation_metrics as metrics
from jaxrat.tasks.base import record_name

SPLITS = ("train", "validation", "test")


def use_split(config: Any, split: str, per_image: bool) -> None:
    """Before the task is made: ask for ``split`` as the eval data (segmentation reads it through
    ``data.eval_split``; other built-in tasks are switched by :func:`swap_to_train`), and for
    per-image segmentation scores, which are those at the original resolution."""
    if split not in SPLITS:
        raise ConfigError(f"--split {split}; use one of {', '.join(SPLITS)}.")
    with config.unlocked():
        config.data.eval_split = split
        binary = int(config.model.get("num_classes", 1) or 1) == 1  # per-image rows are binary scores
        if (per_image and binary and config.task.get("name") == "segmentation"
                and "eval_original_resolution" in config.task):
            config.task.eval_original_resolution = True


def swap_to_train(task: Any, split: str) -> None:
    """Once the data are prepared: classification and detection evaluate their training split."""
    if split == "validation" or type(task).__name__ == "SegmentationTask":
        return
    if split == "test":
        raise ConfigError(f"--split test is available for segmentation (ISIC 2018's test ground truth); "
                          f"{type(task).__name__} evaluates train or validation.")
    if hasattr(task, "train_source"):
        task.val_source = task.train_source
    else:  # detection keeps its splits as COCO datasets
        task._val = task._train


def split_images(task: Any) -> list[InputImage]:
    """The image files of a prepared task's eval split, named by their file name."""
    source = task.val_source if hasattr(task, "val_source") else task._val.example_source()
    out = []
    for i, rec in enumerate(source.records):
        first = rec[0] if isinstance(rec, (tuple, list)) else rec
        path = first.get("path") if isinstance(first, dict) else first
        if isinstance(path, str):
            out.append(InputImage(path, record_name(rec, i)))
    return out


def tiled_segmentation(predictor: Any, task: Any, tile: int, overlap: float) -> tuple[dict[str, float], list]:
    """Metrics (``eval/orig/<name>``) and per-image rows of the eval split predicted in windows
    at full resolution, against the masks as stored. Each process predicts every P-th image."""
    from jaxrat.data.imageio import load_rgb_with_size

    source = task.val_source
    p, count = jax.process_index(), jax.process_count()
    rows = []
    for i in range(p, len(source), count):
        pair = source.records[i]
        image, _ = load_rgb_with_size(pair[0])  # upright, like the masks (as in training)
        mask = source.loader.original_mask(pair).astype(bool)
        pred = predictor.predict_tiled(image, tile, overlap).mask
        tp = int(np.count_nonzero(pred & mask))
        fp, fn = int(np.count_nonzero(pred)) - tp, int(np.count_nonzero(mask)) - tp
        rows.append((i, 1, tp, fp, fn, mask.size - tp - fp - fn, *mask.shape))
    per = metrics.OriginalResolution(original_mask=None, threshold=predictor.threshold)
    pad = -(-len(source) // count) - len(rows)  # equal row counts for the gather
    per.rows = rows + [(0, 0, 0, 0, 0, 0, 0, 0)] * pad
    named = {f"eval/{metrics.ORIGINAL_PREFIX}{k}": v for k, v in metrics.finalize_metrics(per.sums()).items()}
    return named, per.per_image(lambda i: record_name(source.records[i], i))


def save_predictions(predictor: Any, task: Any, out: str) -> dict[str, Any]:
    """Write ``jaxrat.predict``'s files for the eval split into ``out``."""
    from jaxrat.inference.run import Options, predict_files

    os.makedirs(out, exist_ok=True)
    sync = None
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        sync = lambda: multihost_utils.sync_global_devices("evaluate: predictions written")  # noqa: E731
    return predict_files(predictor, split_images(task), out, Options(), process_index=jax.process_index(),
                         process_count=jax.process_count(), progress=False, sync=sync)
