"""Detection's data: COCO records decoded with their stored size, the letterbox/jitter/flip ops that
keep boxes aligned, and the task's batch fields (see :mod:`jaxrat.tasks.detection.task`). The
pipeline's options (workers, threads, prefetch, augmentation defaults) come from
:mod:`jaxrat.data.options`, as for every task.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import grain
import ml_collections as mlc
import numpy as np

from jaxrat.config_schema import field
from jaxrat.data import transforms as T
from jaxrat.data.badfiles import refuse_once
from jaxrat.data.options import eval_coarsen, loader_options, option
from jaxrat.data.sources.coco import DecodeCoco, PadBoxes
from jaxrat.runtime.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class DecodeCocoSized(DecodeCoco):
    """DecodeCoco plus the stored image's ``orig_size`` (w, h) and a content ``mask``.

    The size comes from the record because JPEG draft decoding may return a smaller image; the all-ones
    mask moves with the image through every geometric op, so after letterboxing, cropping and
    flipping its zeros are exactly the padding."""

    def map(self, rec: dict[str, Any]) -> T.Example:
        ex = super().map(rec)
        ex["orig_size"] = np.asarray([rec["width"], rec["height"]], np.float32)
        ex["mask"] = np.ones(ex["image"].shape[:2], np.uint8)
        return ex


@dataclasses.dataclass(frozen=True)
class FinishDetection(grain.transforms.Map):
    """Normalised, padded example -> the task's batch fields (see the module docstring)."""

    def map(self, ex: T.Example) -> T.Example:
        content = ex["mask"][..., 0] > 0.5
        xyxy = ex["boxes"].astype(np.float32)
        cxcywh = np.stack([(xyxy[:, 0] + xyxy[:, 2]) / 2, (xyxy[:, 1] + xyxy[:, 3]) / 2,
                           xyxy[:, 2] - xyxy[:, 0], xyxy[:, 3] - xyxy[:, 1]], -1)
        out = {
            "image": ex["image"],
            "pad_mask": (~content).astype(np.float32),
            "boxes": cxcywh * ex["box_valid"][:, None],
            "labels": ex["labels"].astype(np.int32),
            "box_valid": ex["box_valid"],
            "image_id": np.int32(ex["image_id"]),
            "orig_size": ex["orig_size"],
            # Letterboxing is top-left, so the content is the rows and columns with any content pixel.
            "content_size": np.asarray([content.any(0).sum(), content.any(1).sum()], np.float32),
        }
        if "valid" in ex:
            out["valid"] = ex["valid"]
        return out


def detection_ops(image_size: int, max_boxes: int, *, train: bool, data_cfg: Any = None) -> list:
    """Letterbox to the canvas (train: scale jitter + flip), normalise, pad the boxes, finish.
    The options are the pipeline's (:func:`jaxrat.data.options.option`: its defaults where
    ``data_cfg`` lacks a field, or is None)."""
    get = functools.partial(option, data_cfg if data_cfg is not None else {})
    jitter = tuple(float(s) for s in get("scale_jitter"))
    if train and jitter != (1.0, 1.0):
        ops: list = [T.ScaleJitter(image_size, scale=jitter)]
    else:
        ops = [T.Resize(image_size, keep_aspect=True)]
    if train and get("random_flip"):
        ops.append(T.RandomFlip(horizontal=0.5, vertical=0.0))  # scenes have an up: no vertical flip
    if train and get("color_jitter"):
        c = float(get("color_jitter"))
        ops.append(T.ColorJitter(c, c, c, c / 2))
    if not train and data_cfg is not None:
        ops += [op for op in (eval_coarsen(data_cfg),) if op]
    return ops + [T.Normalize(), PadBoxes(max_boxes), FinishDetection()]


def train_iterator(train: Any, data_cfg: Any, max_boxes: int, *, seed: int, start_example: int, local_batch: int,
                   process_index: int, process_count: int, processes_on_host: int) -> Any:
    """The training stream of COCO split ``train``: the pipeline's iterator with the detection ops and
    the pipeline's own reading options."""
    from jaxrat.data import pipeline

    return pipeline.train_iterator(
        train.example_source(), image_size=data_cfg.image_size, local_batch=local_batch, seed=seed,
        process_index=process_index, process_count=process_count, start_example=start_example,
        processes_on_host=processes_on_host, ops=detection_ops(data_cfg.image_size, max_boxes, train=True,
                                                               data_cfg=data_cfg),
        **loader_options(data_cfg))


def eval_batches(val: Any, data_cfg: Any, max_boxes: int, *, global_batch: int, process_index: int,
                 process_count: int) -> Any:
    """The eval batches of COCO split ``val`` (detection ops, the pipeline's reading options)."""
    from jaxrat.data import pipeline

    return pipeline.eval_batches(val.example_source(), image_size=data_cfg.image_size, global_batch=global_batch,
                                 process_index=process_index, process_count=process_count,
                                 num_threads=option(data_cfg, "num_threads"),
                                 ops=detection_ops(data_cfg.image_size, max_boxes, train=False, data_cfg=data_cfg))


def example_batch(config: mlc.ConfigDict) -> dict[str, np.ndarray]:
    """One all-zero training example (a batch of 1) with every field, shape and dtype of a train batch
    of ``config``: what lowering or sizing the step from shapes alone needs (no data)."""
    s, t, f = int(config.data.image_size), int(config.task.max_boxes), np.float32
    return {"image": np.zeros((1, s, s, 3), f), "pad_mask": np.zeros((1, s, s), f), "boxes": np.zeros((1, t, 4), f),
            "labels": np.zeros((1, t), np.int32), "box_valid": np.zeros((1, t), f),
            "image_id": np.zeros((1,), np.int32), "orig_size": np.zeros((1, 2), f), "content_size": np.zeros((1, 2), f)}


@refuse_once
def resolve_coco(data_cfg: Any, workdir: str, *, seed: int, process_index: int):
    """(train, validation) :class:`CocoDetection` for ``config.data``; writes synthetic COCO if asked."""
    from jaxrat.data.badfiles import SKIPPED_FILES_NAME, BadFilePolicy
    from jaxrat.data.sources.coco import CocoDetection

    if int(field(data_cfg, "data.folds") or 0):
        raise ConfigError("config.data.folds: cross-validation folds are not implemented for COCO detection; "
                          "set --config.data.folds=0 (COCO's val2017 is the validation split).")
    record = os.path.join(workdir, SKIPPED_FILES_NAME) if process_index == 0 else None
    policy = BadFilePolicy(field(data_cfg, "data.on_bad_file"), record)
    root = os.path.expanduser(data_cfg.data_dir or "")
    if data_cfg.synthetic and not root:
        from jaxrat.data.datasets import synthetic_image_size
        from jaxrat.data.synthetic import location
        from jaxrat.data.synthetic.coco import write_coco

        size = synthetic_image_size(data_cfg)
        root = write_coco(location.folder(workdir, process_index), num_train=data_cfg.synthetic_train,
                          num_val=data_cfg.synthetic_val, image_size=size, seed=seed,
                          num_classes=data_cfg.get("synthetic_classes", 5),
                          found_in=location.run_copies(process_index))
    root = root or os.path.expanduser("~/data/coco2017")
    train = CocoDetection(root, "train", policy=policy, skip_empty=True)
    val = CocoDetection(root, "validation", policy=policy, categories=train)
    for ds in (train, val):
        ds.loader = DecodeCocoSized()
    return train, val
