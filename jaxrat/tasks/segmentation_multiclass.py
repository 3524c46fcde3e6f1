"""Multi-class segmentation (``model.num_classes`` >= 2): softmax cross-entropy + soft Dice, and
Dice/IoU per class and their mean, from confusion counts pooled over the whole eval split.

Masks hold a class per pixel; :data:`IGNORE_INDEX` (255) pixels count nowhere (not in the loss,
not in the metrics). Per class ``c``, over every valid pixel of the split: ``dice/<c>`` =
2 tp / (2 tp + fp + fn), ``iou/<c>`` = tp / (tp + fp + fn) (1 when the class is neither present nor
predicted); ``dice`` and ``iou`` are their mean over the foreground classes (1..C-1), ``dice_all``
and ``iou_all`` over every class; ``pixel_accuracy`` the share of valid pixels labelled right.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrat.tasks.base import Batch, EvalAccumulator, host_rows

IGNORE_INDEX = 255
_EPS = 1e-6


def class_names(names: Sequence[str], num_classes: int) -> tuple[str, ...]:
    """``task.class_names`` when it names every class, else ``class_0``, ``class_1``, ..."""
    names = tuple(str(n) for n in names or ())
    return names if len(names) == num_classes else tuple(f"class_{c}" for c in range(num_classes))


def _targets(mask: jax.Array, num_classes: int) -> tuple[jax.Array, jax.Array]:
    labels = mask[..., 0].astype(jnp.int32)
    keep = labels != IGNORE_INDEX
    return jax.nn.one_hot(jnp.where(keep, labels, 0), num_classes) * keep[..., None], keep


def loss_fn(logits: jax.Array, mask: jax.Array, *, ce_weight: float, dice_weight: float) -> tuple[jax.Array, dict]:
    """``ce_weight * cross-entropy + dice_weight * (1 - mean foreground soft Dice)`` over the
    non-ignored pixels of the batch; returns (loss, parts)."""
    logits = logits.astype(jnp.float32)
    onehot, keep = _targets(mask, logits.shape[-1])
    logp = jax.nn.log_softmax(logits)
    ce = -(onehot * logp).sum(-1).sum() / jnp.maximum(keep.sum(), 1)
    p = jnp.exp(logp) * keep[..., None]
    inter, total = (p * onehot).sum((0, 1, 2)), (p + onehot).sum((0, 1, 2))
    dice = (2 * inter + _EPS) / (total + _EPS)
    dice_loss = 1.0 - dice[1:].mean()
    return ce_weight * ce + dice_weight * dice_loss, {"ce": ce, "dice_loss": dice_loss}


def eval_sums(logits: jax.Array, mask: jax.Array, valid: jax.Array, *, ce_weight: float,
              dice_weight: float) -> dict[str, jax.Array]:
    """Per-class confusion counts of the valid images' non-ignored pixels, and the loss sum."""
    num_classes = logits.shape[-1]
    onehot, keep = _targets(mask, num_classes)
    v = valid.astype(jnp.float32)[:, None, None]
    weight = keep * v
    pred = jax.nn.one_hot(jnp.argmax(logits, -1), num_classes) * weight[..., None]
    truth = onehot * weight[..., None]
    tp, npred, ntrue = (pred * truth).sum((0, 1, 2)), pred.sum((0, 1, 2)), truth.sum((0, 1, 2))
    sums = {"pixels": weight.sum(), "correct": tp.sum(), "num_images": valid.astype(jnp.float32).sum()}
    for c in range(num_classes):
        sums.update({f"tp_{c}": tp[c], f"fp_{c}": npred[c] - tp[c], f"fn_{c}": ntrue[c] - tp[c]})
    per_image = jax.vmap(lambda lg, m: loss_fn(lg[None], m[None], ce_weight=ce_weight, dice_weight=dice_weight)[0])
    sums["loss_sum"] = (per_image(logits, mask) * valid.astype(jnp.float32)).sum()
    return sums


def finalize(totals: Mapping[str, float], names: Sequence[str]) -> dict[str, float]:
    """The metrics of the module docstring from the summed counts."""
    if not totals:
        return {}
    out: dict[str, float] = {}
    dice, iou = [], []
    for c, name in enumerate(names):
        tp, fp, fn = (totals[f"{k}_{c}"] for k in ("tp", "fp", "fn"))
        dice.append(2 * tp / (2 * tp + fp + fn) if 2 * tp + fp + fn > 0 else 1.0)
        iou.append(tp / (tp + fp + fn) if tp + fp + fn > 0 else 1.0)
        out[f"dice/{name}"], out[f"iou/{name}"] = dice[-1], iou[-1]
    out["dice"], out["iou"] = float(np.mean(dice[1:])), float(np.mean(iou[1:]))
    out["dice_all"], out["iou_all"] = float(np.mean(dice)), float(np.mean(iou))
    out["pixel_accuracy"] = totals["correct"] / max(totals["pixels"], 1.0)
    n = totals["num_images"]
    out["loss"] = totals["loss_sum"] / max(n, 1.0)
    out["num_images"] = n
    return out


def metric_names(names: Sequence[str]) -> tuple[str, ...]:
    """Every metric :func:`finalize` reports, in order."""
    return (("dice", "iou", "dice_all", "iou_all", "pixel_accuracy", "loss", "num_images")
            + tuple(f"{m}/{n}" for n in names for m in ("dice", "iou")))


def colour(labels: np.ndarray, palette: np.ndarray) -> np.ndarray:
    """Class maps (..., H, W) -> RGB floats in [0, 1] by ``palette`` (K, 3) uint8; ignore is white."""
    table = np.concatenate([palette, np.full((256 - len(palette), 3), 255, np.uint8)])[:256]
    return table[labels.astype(np.uint8)].astype(np.float32) / 255.0


def default_palette(num_classes: int) -> np.ndarray:
    """Distinct colours per class (background black), the same wherever jaxrat draws classes."""
    base = np.array([(0, 0, 0), (230, 25, 75), (60, 180, 75), (0, 130, 200), (255, 225, 25), (145, 30, 180),
                     (70, 240, 240), (245, 130, 48), (240, 50, 230), (210, 245, 60), (250, 190, 212),
                     (0, 128, 128), (170, 110, 40), (128, 0, 0), (170, 255, 195), (128, 128, 0)], np.uint8)
    if num_classes <= len(base):
        return base[:num_classes]
    rng = np.random.default_rng(0)
    return np.concatenate([base, rng.integers(40, 256, (num_classes - len(base), 3), dtype=np.uint8)])


# The predicted class of each pixel, on the device: the host fetches one byte a pixel, not C floats.
_labels = jax.jit(lambda probs: jnp.argmax(probs, -1).astype(jnp.uint8))


def image_counts(pred: np.ndarray, mask: np.ndarray, num_classes: int) -> np.ndarray:
    """Per image and class the (tp, fp, fn) pixel counts of predicted classes ``pred`` (B, H, W)
    against class maps ``mask`` (B, H, W[, 1]), ignored pixels left out: an int64 array (B, C, 3)."""
    truth = np.asarray(mask).reshape(np.shape(pred)).astype(np.int64)
    keep = truth != IGNORE_INDEX
    out = np.zeros((len(truth), num_classes, 3), np.int64)
    for c in range(num_classes):
        p, t = (pred == c) & keep, (truth == c) & keep
        tp = np.count_nonzero(p & t, axis=(1, 2))
        out[:, c] = np.stack([tp, np.count_nonzero(p, axis=(1, 2)) - tp, np.count_nonzero(t, axis=(1, 2)) - tp], -1)
    return out


class MulticlassEval(EvalAccumulator):
    """Adds the per-batch counts; logs the first images with their true and predicted classes;
    with ``name`` (index -> image name) and batches carrying ``index``, keeps each image's per-class
    counts at the model's resolution for :meth:`per_image`."""

    def __init__(self, names: Sequence[str], log_images: bool, name: Callable[[int], str] | None = None) -> None:
        super().__init__()
        self._names, self._want_images = tuple(names), log_images
        self._images: dict[str, np.ndarray] = {}
        self._name = name
        self._rows: list[np.ndarray] = []  # (index, valid, tp_0, fp_0, fn_0, tp_1, ...) per image

    def update(self, sums: Mapping[str, jax.Array], batch: Batch, outputs: Any) -> None:
        self.add_sums(sums)
        if self._name is not None and "index" in batch:
            counts = image_counts(host_rows(_labels(outputs)), batch["mask"], len(self._names))
            head = np.stack([np.asarray(batch["index"], np.int64), np.asarray(batch["valid"]) > 0], -1)
            self._rows.append(np.concatenate([head, counts.reshape(len(counts), -1)], -1))
        if self._want_images and not self._images:
            from jaxrat.data.pipeline import IMAGENET_MEAN, IMAGENET_STD

            n = min(4, int(np.sum(batch["valid"])))
            if n == 0:
                return
            palette = default_palette(len(self._names))
            pred = np.argmax(host_rows(outputs)[:n], -1)
            image = np.clip((batch["image"][:n] * IMAGENET_STD + IMAGENET_MEAN) / 255.0, 0, 1)
            self._images = {"eval/input": image, "eval/mask": colour(batch["mask"][:n, ..., 0], palette),
                            "eval/prediction": colour(pred, palette),
                            "eval/overlay": 0.5 * image + 0.5 * colour(pred, palette)}

    def finalize(self) -> dict[str, float]:
        return finalize(self.fetched_totals(), self._names)

    def per_image(self) -> list[dict[str, Any]]:
        """One row per valid eval image, in example order: ``image``, ``dice`` and ``iou`` (the mean
        over foreground classes), ``pixel_accuracy``, then ``dice/<class>`` and ``iou/<class>`` of
        every class (1 where the class is neither in the mask nor predicted, as in :func:`finalize`).
        A collective under several processes."""
        if self._name is None:
            return []
        k = len(self._names)
        rows = np.concatenate(self._rows) if self._rows else np.zeros((0, 2 + 3 * k), np.int64)
        if jax.process_count() > 1:  # int32 (JAX's default width): an image's pixel counts, exact to 2^31
            from jax.experimental import multihost_utils

            rows = rows.astype(np.int32)
            rows = np.asarray(multihost_utils.process_allgather(rows, tiled=True))
        rows = rows[rows[:, 1] > 0]
        rows = rows[np.argsort(rows[:, 0], kind="stable")]
        out = []
        for r in rows:
            counts = r[2:].reshape(k, 3).astype(np.float64)
            row: dict[str, Any] = {"image": self._name(int(r[0]))}
            dice, iou = {}, {}
            for c, name in enumerate(self._names):
                tp, fp, fn = counts[c]
                dice[name] = 2 * tp / (2 * tp + fp + fn) if 2 * tp + fp + fn > 0 else 1.0
                iou[name] = tp / (tp + fp + fn) if tp + fp + fn > 0 else 1.0
            fg = self._names[1:]
            pixels = counts[:, 0].sum() + counts[:, 1].sum()  # every kept pixel is predicted as one class
            row.update(dice=float(np.mean([dice[n] for n in fg])), iou=float(np.mean([iou[n] for n in fg])),
                       pixel_accuracy=float(counts[:, 0].sum() / pixels) if pixels else 1.0)
            for name in self._names:
                row[f"dice/{name}"], row[f"iou/{name}"] = float(dice[name]), float(iou[name])
            out.append(row)
        return out

    def images(self) -> dict[str, np.ndarray]:
        return self._images
