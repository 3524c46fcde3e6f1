"""Binary segmentation (ISIC 2018 lesions): BCE + soft Dice loss, and eval metrics over a whole eval set.

Eval metrics are computed from sums, so they are exact whatever the batch split: each eval step
returns per-batch sums (inside jit, so they are reduced across all devices and hosts) and
:func:`finalize_metrics` turns the accumulated sums into the metrics of
:mod:`jaxrat.tasks.segmentation_metrics` (per-image Dice, IoU and the ISIC challenge's thresholded
Jaccard; pooled and per-image sensitivity, specificity, accuracy). With
``config.task.eval_original_resolution`` the same metrics are also computed at each image's
original resolution (``eval/orig/...``): the predicted probabilities are resized back on the host
and compared with the mask as stored, as the challenge scores submissions.

``config.task.multiscale_loss`` (multi-scale RAT only): the loss is the mean of the loss of every
pyramid level's prediction against the mask resized (nearest) to that level, as in the reference;
otherwise only the finest level is supervised. Metrics always use the finest level.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
import ml_collections as mlc
import numpy as np
import optax
from flax import nnx

from jaxrat.config_schema import field
from jaxrat.runtime.errors import ConfigError
from jaxrat.tasks import segmentation_metrics as metrics
from jaxrat.tasks import segmentation_multiclass as multiclass
from jaxrat.tasks.base import Batch, EvalAccumulator, host_rows, record_name
from jaxrat.tasks.image_task import ImageTask

_EPS = 1e-6


def loss_fn(logits: jax.Array, mask: jax.Array, *, bce_weight: float, dice_weight: float) -> tuple[jax.Array, dict]:
    """``bce_weight * BCE + dice_weight * (1 - mean per-image soft Dice)``; returns (loss, parts)."""
    logits = logits.astype(jnp.float32)
    bce = optax.sigmoid_binary_cross_entropy(logits, mask).mean()
    p = jax.nn.sigmoid(logits)
    axes = tuple(range(1, p.ndim))
    inter = (p * mask).sum(axes)
    dice = (2 * inter + _EPS) / (p.sum(axes) + mask.sum(axes) + _EPS)
    dice_loss = 1.0 - dice.mean()
    loss = bce_weight * bce + dice_weight * dice_loss
    return loss, {"bce": bce, "dice_loss": dice_loss}


def eval_sums(
    logits: jax.Array, mask: jax.Array, valid: jax.Array, *, threshold: float, bce_weight: float, dice_weight: float
) -> dict[str, jax.Array]:
    """Sums over the valid images of a batch, to be added up over the whole eval set."""
    logits = logits.astype(jnp.float32)
    pred = (jax.nn.sigmoid(logits) >= threshold).astype(jnp.float32)
    axes = tuple(range(1, pred.ndim))
    tp = (pred * mask).sum(axes)
    fp = (pred * (1 - mask)).sum(axes)
    fn = ((1 - pred) * mask).sum(axes)
    tn = ((1 - pred) * (1 - mask)).sum(axes)
    bce = optax.sigmoid_binary_cross_entropy(logits, mask).mean(axes)
    p = jax.nn.sigmoid(logits)
    soft = (2 * (p * mask).sum(axes) + _EPS) / (p.sum(axes) + mask.sum(axes) + _EPS)
    loss = bce_weight * bce + dice_weight * (1 - soft)
    v = valid.astype(jnp.float32)
    return {**metrics.sums_from_counts(tp, fp, fn, tn, v, jnp), "loss_sum": (loss * v).sum()}


finalize_metrics = metrics.finalize_metrics
METRICS = metrics.METRICS
# Eval images logged per evaluation (the first ones of the split).
NUM_LOGGED_IMAGES = 4


class SegmentationTask(ImageTask):
    """``config.task``: ``bce_weight``, ``dice_weight`` (loss), ``threshold`` (eval metrics), and
    optionally ``eval_original_resolution`` and ``multiscale_loss`` (both False when absent).

    A batch holds ``image`` (B, H, W, 3) ImageNet-normalised floats and ``mask`` (B, H, W, 1) in
    {0, 1}; eval batches also ``valid`` (1 for a real image, 0 for padding) and, for metrics at the
    original resolution, ``index`` (the example's position in the eval split).
    """

    def __init__(self, config: mlc.ConfigDict) -> None:
        super().__init__(config)
        t = config.task
        missing = [k for k in ("bce_weight", "dice_weight", "threshold") if k not in t]
        if missing:
            raise ConfigError(f"config.task lacks {', '.join(missing)} for the segmentation task; set them in the "
                              f"config file (see configs/isic.py).")
        self.bce_weight, self.dice_weight = float(t.bce_weight), float(t.dice_weight)
        self.threshold = float(t.threshold)
        self.eval_original_resolution = bool(t.get("eval_original_resolution", False))
        self.multiscale_loss = bool(t.get("multiscale_loss", False))
        # 1: binary masks, sigmoid (ISIC); more: class maps, softmax (segmentation_multiclass).
        self.num_classes = int(config.model.get("num_classes", 1) or 1)
        self.class_names = multiclass.class_names(t.get("class_names", ()), self.num_classes)
        self.curve_classes = self.class_names[1:] if self.num_classes > 1 else ()  # class 0 is background
        if self.num_classes > 1 and (self.eval_original_resolution or self.multiscale_loss):
            raise ConfigError(f"config.model.num_classes={self.num_classes}: task.eval_original_resolution and "
                              f"task.multiscale_loss are for binary masks; set them False.")

    def prepare_data(self, workdir: str) -> str:
        from jaxrat.data import datasets

        self.train_source, self.val_source = datasets.resolve_segmentation(
            self.config.data, workdir, seed=self.config.seed, process_index=jax.process_index(),
            num_classes=self.num_classes)
        if self.eval_original_resolution:
            self._original_resolution()  # a source that cannot re-read its masks fails now, not at the first eval
        return f"{len(self.train_source)} train and {len(self.val_source)} validation images"

    def eval_batches(self, *, global_batch: int, process_index: int,
                     process_count: int) -> Iterable[dict[str, np.ndarray]]:
        from jaxrat.data import pipeline

        d = self.config.data
        return pipeline.eval_batches(self.val_source, image_size=d.image_size, global_batch=global_batch,
                                     process_index=process_index, process_count=process_count,
                                     with_index=self.eval_original_resolution or self.num_classes > 1,
                                     **pipeline.eval_options(d))

    def loss(self, model: nnx.Module, batch: Batch, rng: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        kw = dict(bce_weight=self.bce_weight, dice_weight=self.dice_weight)
        mask = batch["mask"]
        if self.num_classes > 1:
            loss, parts = multiclass.loss_fn(model(batch["image"]), mask, ce_weight=self.bce_weight,
                                             dice_weight=self.dice_weight)
            return loss, {**parts, "foreground_fraction": jnp.mean((mask > 0) & (mask != multiclass.IGNORE_INDEX))}
        # The "loss" scope names the loss's ops in profiles and cost tables (benchmarks/gpu_cost.py).
        if not self.multiscale_loss:
            logits = model(batch["image"])
            with jax.named_scope("loss"):
                loss, parts = loss_fn(logits, mask, **kw)
        else:
            levels = model(batch["image"], all_levels=True)
            if len(levels) < 2:
                raise ConfigError("config.task.multiscale_loss=True needs a model that predicts several pyramid "
                                  "levels (a RAT with config.model.rat.scales, as in configs/isic_multiscale.py); "
                                  "set it False otherwise.")
            with jax.named_scope("loss"):
                loss, parts = multiscale_loss_fn(levels, mask, **kw)
        # Exact in float32 (a sum of 0/1 pixels): a fingerprint of which examples a step saw.
        return loss, {**parts, "foreground_fraction": jnp.mean(mask)}

    def eval_step(self, model: nnx.Module, batch: Batch) -> tuple[dict[str, jax.Array], Any]:
        logits = model(batch["image"])
        if self.num_classes > 1:
            sums = multiclass.eval_sums(logits, batch["mask"], batch["valid"], ce_weight=self.bce_weight,
                                        dice_weight=self.dice_weight)
            return sums, jax.nn.softmax(logits.astype(jnp.float32))
        sums = eval_sums(logits, batch["mask"], batch["valid"], threshold=self.threshold,
                         bce_weight=self.bce_weight, dice_weight=self.dice_weight)
        return sums, jax.nn.sigmoid(logits)

    def new_eval(self) -> EvalAccumulator:
        if self.num_classes > 1:
            return multiclass.MulticlassEval(self.class_names, log_images=bool(self.config.train.log_images),
                                             name=lambda i: record_name(self.val_source.records[i], i))
        return _SegmentationEval(log_images=bool(self.config.train.log_images), threshold=self.threshold,
                                 original=self._original_resolution() if self.eval_original_resolution else None,
                                 name=lambda i: record_name(self.val_source.records[i], i))

    def _original_resolution(self) -> metrics.OriginalResolution:
        from jaxrat.data import transforms as T

        source, d = self.val_source, self.config.data
        read = getattr(source.loader, "original_mask", None)
        if read is None:
            where = source.name or "the eval set"
            raise ConfigError(f"config.task.eval_original_resolution=True: the loader of {where} cannot read masks "
                              "as stored; set it False.")
        keep = bool(field(d, "data.keep_aspect_ratio"))
        return metrics.OriginalResolution(
            original_mask=lambda i: read(source.records[i]), threshold=self.threshold,
            content=(lambda h, w: T.letterbox_shape(h, w, d.image_size)) if keep else (lambda h, w: None))

    @property
    def metric_names(self) -> tuple[str, ...]:
        if self.num_classes > 1:
            return multiclass.metric_names(self.class_names)
        return METRICS + (metrics.ORIGINAL_METRICS if self.eval_original_resolution else ())


def multiscale_loss_fn(level_logits: Sequence[jax.Array], mask: jax.Array, *, bce_weight: float,
                       dice_weight: float) -> tuple[jax.Array, dict]:
    """The mean over pyramid levels of :func:`loss_fn`, each level's logits against ``mask`` resized
    (nearest) to that level; the parts are averaged too, and ``loss_level_<k>`` added."""
    losses, parts = [], []
    for logits in level_logits:
        target = mask if logits.shape[1:3] == mask.shape[1:3] else jax.image.resize(
            mask, (*mask.shape[:1], *logits.shape[1:3], mask.shape[-1]), "nearest")
        loss, p = loss_fn(logits, target, bce_weight=bce_weight, dice_weight=dice_weight)
        losses.append(loss)
        parts.append(p)
    mean = {k: sum(p[k] for p in parts) / len(parts) for k in parts[0]}
    return sum(losses) / len(losses), {**mean, **{f"loss_level_{k}": v for k, v in enumerate(losses)}}


def overlay(image: np.ndarray, truth: np.ndarray, pred: np.ndarray) -> np.ndarray:
    """The input with the ground truth tinted green and the prediction red (both: yellow).

    ``image`` (N, H, W, 3) in [0, 1]; ``truth`` and ``pred`` boolean (N, H, W, 1)."""
    tint = np.concatenate([pred, truth, np.zeros_like(pred)], -1).astype(np.float32)
    marked = (truth | pred).astype(np.float32)
    return image * (1 - 0.5 * marked) + 0.5 * tint


class _SegmentationEval(EvalAccumulator):
    def __init__(self, log_images: bool, threshold: float = 0.5,
                 original: metrics.OriginalResolution | None = None, name: Any = str) -> None:
        super().__init__()
        self._want_images, self._threshold = log_images, threshold
        self._images: dict[str, np.ndarray] = {}
        self._original = original
        self._name = name

    def per_image(self) -> list[dict[str, Any]]:
        """Scores at each image's original resolution (with ``task.eval_original_resolution``)."""
        return self._original.per_image(self._name) if self._original is not None else []

    def update(self, sums: Mapping[str, jax.Array], batch: Batch, outputs: Any) -> None:
        self.add_sums(sums)
        if self._original is not None:
            self._original.update(host_rows(outputs), batch["index"], batch["valid"])
        if self._want_images and not self._images:
            from jaxrat.data.pipeline import IMAGENET_MEAN, IMAGENET_STD

            n = min(NUM_LOGGED_IMAGES, int(np.sum(batch["valid"])))
            if n == 0:  # this process's share of the first batch is all padding
                return
            probs = host_rows(outputs)[:n]
            image = np.clip((batch["image"][:n] * IMAGENET_STD + IMAGENET_MEAN) / 255.0, 0, 1)
            self._images = {
                "eval/input": image,
                "eval/mask": np.repeat(batch["mask"][:n], 3, -1),
                "eval/prediction": np.repeat(probs, 3, -1),
                "eval/overlay": overlay(image, batch["mask"][:n] > 0.5, probs >= self._threshold),
            }

    def finalize(self) -> dict[str, float]:
        out = finalize_metrics(self.fetched_totals())
        if self._original is not None:
            out.update({metrics.ORIGINAL_PREFIX + k: v for k, v in finalize_metrics(self._original.sums()).items()})
        return out

    def images(self) -> dict[str, np.ndarray]:
        return self._images
