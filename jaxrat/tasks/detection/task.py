"""Object detection on COCO 2017 (``config.task.name = "detection"``): DETR set loss, COCOeval metrics.

Data: the official COCO layout (``jaxrat.data.sources.coco``), or with ``data.synthetic`` a small
synthetic COCO written under the workdir. Every image is letterboxed to the square canvas
``data.image_size`` (top-left, zero padding). A batch holds

- ``image`` (B, S, S, 3) ImageNet-normalised, ``pad_mask`` (B, S, S) 1 on padding (RAT's polarity),
- ``boxes`` (B, T, 4) normalised ``(cx, cy, w, h)`` on the canvas, ``labels`` (B, T) contiguous
  ids, ``box_valid`` (B, T) with T = ``task.max_boxes``;
- eval batches also ``valid``, ``image_id``, ``orig_size`` (w, h) of the stored image and
  ``content_size`` (w, h) of the image on the canvas: what maps predictions back to COCO pixels.

Training augmentations keep boxes aligned: scale jitter (rescale, then random crop or pad; boxes
leaving the crop are dropped, cut ones clipped) and a left-right flip.

``config.task``: ``max_boxes``, ``cost_class``/``cost_bbox``/``cost_giou`` (matching),
``ce_weight``/``bbox_weight``/``giou_weight`` (loss), ``eos_coef``, ``focal``, ``focal_alpha``,
``focal_gamma``, ``aux_loss``, ``num_detections`` (per image, for COCOeval).
"""

from __future__ import annotations

import functools
from typing import Any, Iterable, Iterator, Mapping

import jax
import jax.numpy as jnp
import ml_collections as mlc
import numpy as np
from flax import nnx

from jaxrat.runtime.errors import ConfigError
from jaxrat.tasks.base import SHARD_TOTALS, Batch, EvalAccumulator, Task, host_rows, local_model_config
from jaxrat.tasks.detection import boxes as box_ops
from jaxrat.tasks.detection import data
from jaxrat.tasks.detection.coco_eval import STAT_NAMES, evaluate, to_coco_results
from jaxrat.tasks.detection.drawing import boxes_images
from jaxrat.tasks.detection.losses import num_target_boxes, set_criterion
from jaxrat.tasks.detection.matching import current_mesh, hungarian_match

METRICS = (*STAT_NAMES, "num_images")


# ------------------------------------------------------------------------------------------ task
class DetectionTask(Task):
    """See the module docstring."""

    def __init__(self, config: mlc.ConfigDict) -> None:
        super().__init__(config)
        self.t = config.task
        queries = int(config.model.get("num_queries", 0) or 0)
        if queries and queries < int(self.t.max_boxes):
            # Every target needs its own query: the matcher cannot assign more boxes than queries.
            raise ConfigError(f"config.model.num_queries={queries} < config.task.max_boxes={self.t.max_boxes}; "
                              f"raise the queries or lower max_boxes.")
        self.num_classes = int(config.model.get("num_classes", 0) or 0)
        self._train = self._val = None
        self.category_ids: list[int] = []
        self.class_names: list[str] = []

    def prepare_data(self, workdir: str) -> str:
        self._train, self._val = data.resolve_coco(self.config.data, workdir, seed=self.config.seed,
                                              process_index=jax.process_index())
        self.num_classes = self._train.num_classes
        self.category_ids, self.class_names = list(self._train.category_ids), list(self._train.class_names)
        return f"{len(self._train)} train and {len(self._val)} validation images ({self.num_classes} classes)"

    def label_space(self) -> dict[str, Any]:
        """The categories, by label: COCO ids and names."""
        return {"categories": [{"id": int(i), "name": str(n)} for i, n in zip(self.category_ids, self.class_names)]}

    def use_label_space(self, saved: dict[str, Any]) -> None:
        cats = saved["categories"]
        self.category_ids, self.class_names = [int(c["id"]) for c in cats], [str(c["name"]) for c in cats]
        self.num_classes = len(cats)

    def num_train_examples(self) -> int:
        return len(self._train) if self._train is not None else 0

    def train_iterator(self, start_example: int, *, local_batch: int, process_index: int, process_count: int,
                       processes_on_host: int) -> Iterator[dict[str, np.ndarray]]:
        return data.train_iterator(self._train, self.config.data, int(self.t.max_boxes), seed=self.config.seed,
                                   start_example=start_example, local_batch=local_batch, process_index=process_index,
                                   process_count=process_count, processes_on_host=processes_on_host)

    def eval_batches(self, *, global_batch: int, process_index: int,
                     process_count: int) -> Iterable[dict[str, np.ndarray]]:
        return data.eval_batches(self._val, self.config.data, int(self.t.max_boxes), global_batch=global_batch,
                                 process_index=process_index, process_count=process_count)

    def build_model(self, *, dtype: Any, rngs: nnx.Rngs, kernels: Any) -> nnx.Module:
        from jaxrat.models import build_model

        model_config = mlc.ConfigDict(local_model_config(self.config.model).to_dict())
        model_config.num_classes = self.num_classes
        model_config.focal = bool(self.t.focal)
        return build_model(model_config, dtype=dtype, rngs=rngs, kernels=kernels)

    # ------------------------------------------------------------------------- inside jit
    def loss(self, model: nnx.Module, batch: Batch, rng: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        t = self.t
        logits, pred_boxes = model(batch["image"], batch["pad_mask"])
        layers = [(logits[i], pred_boxes[i]) for i in range(logits.shape[0])]
        if not t.aux_loss:
            layers = layers[-1:]
        valid = batch["box_valid"] > 0
        totals = batch.get(SHARD_TOTALS)
        if totals is None:  # under the GSPMD step the arrays are global: this counts every device's boxes
            num_boxes = num_target_boxes(valid)
        else:  # one fixed shard: the whole batch's count over the number of shards (see Task.batch_totals)
            num_boxes = jnp.where(totals["num_boxes"] > 0, totals["num_boxes"], 1.0)
        with jax.named_scope("loss"):  # names the matching and the criterion in profiles and cost tables
            total, parts = set_criterion(
                layers, batch["labels"], batch["boxes"], valid, num_boxes,
                cost_class=float(t.cost_class), cost_bbox=float(t.cost_bbox), cost_giou=float(t.cost_giou),
                ce_weight=float(t.ce_weight), bbox_weight=float(t.bbox_weight), giou_weight=float(t.giou_weight),
                focal=bool(t.focal), eos_coef=float(t.eos_coef), focal_alpha=float(t.focal_alpha),
                focal_gamma=float(t.focal_gamma), matcher=functools.partial(hungarian_match, mesh=current_mesh()))
        logged = {k: parts[k] for k in ("loss_ce", "loss_bbox", "loss_giou")}
        return total, {**logged, "boxes_per_image": jnp.mean(valid.sum(-1).astype(jnp.float32))}

    def batch_totals(self, batch: Batch) -> dict[str, jax.Array]:
        return {"num_boxes": jnp.sum(batch["box_valid"] > 0, dtype=jnp.float32)}

    def eval_step(self, model: nnx.Module, batch: Batch) -> tuple[dict[str, jax.Array], Any]:
        logits, pred_boxes = model(batch["image"], batch["pad_mask"])
        scores, labels, boxes = postprocess(logits[-1], pred_boxes[-1], focal=bool(self.t.focal),
                                            num_detections=int(self.t.num_detections))
        return {"num_images": jnp.sum(batch["valid"])}, {"scores": scores, "labels": labels, "boxes": boxes}

    # ----------------------------------------------------------------------------- host side
    def new_eval(self) -> EvalAccumulator:
        return DetectionEval(self._val.annotation_file, self._val.category_ids,
                             log_images=bool(self.config.train.log_images))

    @property
    def metric_names(self) -> tuple[str, ...]:
        return METRICS


def postprocess(logits: jax.Array, pred_boxes: jax.Array, *, focal: bool,
                num_detections: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Top detections per image: (scores (B, K), contiguous labels (B, K), canvas-normalised xyxy (B, K, 4)).

    Softmax: each query's best real class (DETR). Focal: the best (query, class) pairs over all of
    them (Deformable DETR), so one query may report several classes.
    """
    logits = logits.astype(jnp.float32)
    xyxy = box_ops.cxcywh_to_xyxy(pred_boxes.astype(jnp.float32))
    q = logits.shape[1]
    if focal:
        c = logits.shape[-1]
        flat = jax.nn.sigmoid(logits).reshape(logits.shape[0], -1)
        scores, idx = jax.lax.top_k(flat, min(num_detections, flat.shape[1]))
        labels, query = idx % c, idx // c
    else:
        prob = jax.nn.softmax(logits, -1)[..., :-1]
        best, cls = prob.max(-1), prob.argmax(-1)
        scores, query = jax.lax.top_k(best, min(num_detections, q))
        labels = jnp.take_along_axis(cls, query, 1)
    boxes = jnp.take_along_axis(xyxy, query[..., None], 1)
    return scores, labels.astype(jnp.int32), boxes


def to_original(boxes: np.ndarray, content_size: np.ndarray, canvas: int) -> np.ndarray:
    """Canvas-normalised xyxy (N, K, 4) -> normalised to the original image, clipped to it."""
    scale = (canvas / np.maximum(content_size, 1.0))[:, None, :]  # (N, 1, 2): w, h
    return np.clip(boxes * np.concatenate([scale, scale], -1), 0.0, 1.0)


class DetectionEval(EvalAccumulator):
    """Collects this process's predictions, gathers every process's in :meth:`finalize`, scores once."""

    FIELDS = ("image_id", "orig_size", "content_size", "valid")

    def __init__(self, annotation_file: str, category_ids: list[int], log_images: bool = False) -> None:
        super().__init__()
        self.annotation_file, self.category_ids = annotation_file, list(category_ids)
        self.rows: dict[str, list[np.ndarray]] = {}
        self._want_images, self._images = log_images, {}

    def update(self, sums: Mapping[str, jax.Array], batch: Batch, outputs: Any) -> None:
        self.add_sums(sums)
        canvas = batch["image"].shape[1]
        local = {k: host_rows(v) for k, v in outputs.items()}
        if self._want_images and not self._images:  # the same first images at every eval
            self._images = boxes_images(batch, local)
        local["boxes"] = to_original(local["boxes"], np.asarray(batch["content_size"]), canvas)
        for k in self.FIELDS:
            local[k] = np.asarray(batch[k])
        for k, v in local.items():
            self.rows.setdefault(k, []).append(v)

    def gathered(self) -> dict[str, np.ndarray]:
        """Every process's rows (same shapes everywhere: eval batches are equal in number and size)."""
        local = {k: np.concatenate(v) for k, v in self.rows.items()}
        if jax.process_count() == 1 or not local:
            return local
        from jax.experimental import multihost_utils

        return {k: np.asarray(v) for k, v in multihost_utils.process_allgather(local, tiled=True).items()}

    def finalize(self) -> dict[str, float]:
        rows = self.gathered()
        n = float(self.fetched_totals().get("num_images", 0.0))
        if not rows:
            return {**{k: 0.0 for k in STAT_NAMES}, "num_images": n}
        keep = rows["valid"] > 0
        k = rows["scores"].shape[1]
        results = to_coco_results(
            self.category_ids, np.repeat(rows["image_id"][keep], k), rows["boxes"][keep].reshape(-1, 4),
            rows["scores"][keep].reshape(-1), rows["labels"][keep].reshape(-1),
            np.repeat(rows["orig_size"][keep], k, axis=0))
        self.results, self._kept = results, {key: v[keep] for key, v in rows.items()}
        return {**evaluate(self.annotation_file, results), "num_images": n}

    # Score from which a detection counts in the per-image table.
    COUNT_SCORE = 0.5

    def per_image(self) -> list[dict[str, Any]]:
        """Per image: ground-truth boxes (non-crowd), detections scoring >= 0.5 and the best score."""
        from jaxrat.data.sources.coco import load_annotations

        kept = getattr(self, "_kept", None)
        if not kept:
            return []
        gt = load_annotations(self.annotation_file)
        out = []
        for iid, (w, h), scores in zip(kept["image_id"].tolist(), kept["orig_size"].tolist(), kept["scores"]):
            info = gt.imgs.get(int(iid), {})
            out.append({"image": info.get("file_name", str(iid)), "image_id": int(iid), "width": int(w),
                        "height": int(h), "ground_truth": len(gt.getAnnIds(imgIds=[int(iid)], iscrowd=False)),
                        "detections": int(np.sum(scores >= self.COUNT_SCORE)),
                        "best_score": float(np.max(scores)) if len(scores) else 0.0})
        return out

    def per_image_summary(self) -> dict[str, Any]:
        """``per_category_AP``: the AP of each category (by name) over the split."""
        from jaxrat.tasks.detection.coco_eval import per_category_ap

        return {"per_category_AP": per_category_ap(self.annotation_file, getattr(self, "results", []))}

    def images(self) -> dict[str, np.ndarray]:
        """The first eval images with true (green) and detected (red) boxes."""
        return self._images
