"""A trained run as a function on images: :class:`Predictor`.

Loaded from a workdir (its ``config.json`` and a checkpoint, through the same state spec and
restore as ``jaxrat.evaluate``), it preprocesses an image exactly as evaluation does (the eval
ops of the run's config: resize or letterbox, normalisation), runs the jitted model over this
process's devices in batches (the last one padded), and maps the outputs back onto each image at
its original size: probabilities for segmentation, per-head class probabilities for
classification, boxes in pixels for detection.

    from jaxrat.inference import Predictor
    p = Predictor.from_workdir("runs/demo")
    [pred] = p([image])          # image: uint8 (H, W, 3); pred.probability: (H, W) float32
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import tempfile
from typing import Any, Sequence

import jax
import ml_collections as mlc
import numpy as np

from jaxrat.checkpointing import load_init
from jaxrat.checkpointing.reading import Opened, open_checkpoint
from jaxrat.config_schema import field, load_run_config
from jaxrat.data.synthetic import location
from jaxrat.inference import augment
from jaxrat.inference.batch import check_batch
from jaxrat.parallel.mesh import make_mesh
from jaxrat.runtime.errors import ConfigError, UserError
from jaxrat.tasks.base import load_task
from jaxrat.trainer import label_space
from jaxrat.trainer.state import make_state_spec

KINDS = {"SegmentationTask": "segmentation", "ClassificationTask": "classification", "DetectionTask": "detection"}


@dataclasses.dataclass
class Prediction:
    """One image's outputs at its original size. Segmentation: ``probability`` (H, W) and ``mask``
    (H, W) bool (multi-class: ``labels`` (H, W) uint8 classes, ``probability`` the winning class's,
    ``class_probabilities`` (H, W, C) every class's, ``mask`` not background); classification: ``heads``
    {head: (classes,) probabilities}; detection: ``boxes`` (K, 4) x1, y1, x2, y2 in pixels, ``scores`` (K,),
    ``labels`` (K,) contiguous class indices."""

    width: int
    height: int
    probability: np.ndarray | None = None
    mask: np.ndarray | None = None
    heads: dict[str, np.ndarray] | None = None
    boxes: np.ndarray | None = None
    scores: np.ndarray | None = None
    labels: np.ndarray | None = None
    class_probabilities: np.ndarray | None = None


class Predictor:
    """A checkpoint of a trained run, callable on uint8 RGB images (see the module docstring).

    ``batch_size``: images per forward pass over this process's devices (0: the run's
    ``data.eval_batch_size``, rounded up to the device count); ``tta``: test-time augmentation
    (segmentation, classification); ``data_dir``: where classification and detection runs without a
    ``WORKDIR/labels.json`` (from before it was written) re-read their label names (a temporary folder
    when empty; synthetic data is read from the run's copy, or regenerated there when it has none).
    """

    def __init__(self, config: mlc.ConfigDict, workdir: str, step: str = "latest", *, batch_size: int = 0,
                 tta: augment.TTA = augment.TTA(), data_dir: str = "", opened: Opened | None = None) -> None:
        check_batch(batch_size, "batch_size")
        self.config, self.workdir, self.tta = config, workdir, tta
        with contextlib.ExitStack() as stack:  # held from resolving to loading: a training may rotate it away
            if opened is None:
                opened = stack.enter_context(open_checkpoint(f"{workdir}:{step}", ("params", "ema_params"),
                                                             together=False))
            self._load(batch_size, data_dir, opened)

    def _load(self, batch_size: int, data_dir: str, opened: Opened) -> None:
        config, tta = self.config, self.tta
        self.step = opened.step
        self.task = load_task(config)
        self.kind = KINDS.get(type(self.task).__name__)
        if self.kind is None:
            raise ConfigError(f"Prediction supports the built-in tasks ({', '.join(KINDS.values())}), not "
                              f"{config.task.name}; call your task's model yourself.")
        if self.kind == "detection" and tta.active:
            raise UserError("--tta is not available for detection (averaging boxes needs box fusion, which jaxrat "
                            "does not implement); drop --tta.")
        self.image_size = int(config.data.image_size)
        self.threshold = float(config.task.get("threshold", 0.5))
        self.labels: dict[str, list[str]] = {}
        self.category_ids: list[int] = []
        self.category_names: list[str] = []
        if self.kind != "segmentation":
            self._read_label_names(data_dir)
        devices = jax.local_devices()
        # This process's devices only: processes predict their own images and never wait for each other.
        self.mesh = make_mesh(config.mesh.axes, devices)
        n = len(devices)
        batch = int(batch_size or config.data.get("eval_batch_size", n))
        self.batch_size = -(-batch // n) * n
        self.spec = make_state_spec(config, self.mesh, self.task)
        # A run trained with an average of its weights predicts with it, as evaluate scores it.
        self.params = load_init(opened.spec, self.spec.abstract_with_shardings(), opened=opened,
                                params_from="ema_params" if self.spec.ema else "params")["params"]
        self._forward = jax.jit(self._outputs, in_shardings=(self.spec.state_shardings["params"],
                                                              self.spec.batch_sharding),
                                out_shardings=self.spec.batch_sharding)
        self._ops = self._eval_ops()

    @classmethod
    def from_workdir(cls, workdir: str, step: str = "latest", overrides: Sequence[str] = (),
                     allow_import: Sequence[str] = (), **kw: Any) -> Predictor:
        """The run in ``workdir`` (its config with ``--config.KEY=VALUE`` ``overrides``) at ``step``
        ("latest", "best" or a number); ``allow_import``: modules its config.json may name a task from."""
        workdir = os.path.abspath(os.path.expanduser(workdir))
        return cls(load_run_config(workdir, list(overrides), allow_import), workdir, step, **kw)

    # ------------------------------------------------------------------------------- setup
    def _read_label_names(self, data_dir: str) -> None:
        saved = label_space.saved(self.workdir)
        if saved is not None:  # what the run was trained with: no dataset needed, and none changed since misread
            self.task.use_label_space(saved)
            logging.info("labels: from %s", os.path.join(self.workdir, label_space.LABELS_NAME))
        else:  # a run from before labels.json: its dataset says
            temp = "" if data_dir else tempfile.mkdtemp(prefix="jaxrat_predict_")
            try:
                with location.reading_run(self.workdir):  # the run's synthetic data, when it kept it
                    logging.info("labels: %s", self.task.prepare_data(data_dir or temp))
            finally:
                if temp:
                    shutil.rmtree(temp, ignore_errors=True)
        if self.kind == "classification":
            self.labels = {h: [str(x) for x in self.task.vocabularies.get(h) or []] for h in self.task.heads}
        else:
            self.category_ids, self.category_names = list(self.task.category_ids), list(self.task.class_names)

    def _eval_ops(self) -> list:
        d = self.config.data
        if self.kind == "detection":
            from jaxrat.tasks.detection.data import detection_ops

            return detection_ops(self.image_size, int(self.config.task.max_boxes), train=False, data_cfg=d)
        from jaxrat.data import pipeline

        return list(pipeline.eval_options(d)["ops"])

    @property
    def keep_aspect(self) -> bool:
        return self.kind == "detection" or bool(field(self.config.data, "data.keep_aspect_ratio"))

    def label_name(self, head: str, index: int) -> str:
        """The original label string of class ``index`` of ``head`` (its number when the data had none)."""
        names = self.labels.get(head) or []
        return names[index] if index < len(names) else str(index)

    # ------------------------------------------------------------------------------- jitted
    def _outputs(self, params: Any, batch: dict) -> Any:
        model = self.spec.model(params, jax.random.key(0), train=False)
        if self.kind == "segmentation":
            return augment.segmentation_probs(model, batch["image"], self.tta)
        if self.kind == "classification":
            return augment.classification_probs(model, batch["image"], self.tta)
        from jaxrat.tasks.detection.task import postprocess

        logits, boxes = model(batch["image"], batch["pad_mask"])
        t = self.config.task
        scores, labels, xyxy = postprocess(logits[-1], boxes[-1], focal=bool(t.focal),
                                           num_detections=int(t.num_detections))
        return {"scores": scores, "labels": labels, "boxes": xyxy}

    def run_batch(self, inputs: dict[str, np.ndarray]) -> Any:
        """The jitted outputs of model inputs with any leading size (padded to whole batches), as numpy."""
        n = len(next(iter(inputs.values())))
        outs = []
        for start in range(0, n, self.batch_size):
            chunk = {k: v[start:start + self.batch_size] for k, v in inputs.items()}
            m = len(next(iter(chunk.values())))
            pad = -(-m // len(self.mesh.devices.flat)) * len(self.mesh.devices.flat) - m
            if pad:
                chunk = {k: np.concatenate([v, np.repeat(v[-1:], pad, 0)]) for k, v in chunk.items()}
            placed = {k: jax.device_put(np.asarray(v), self.spec.batch_sharding) for k, v in chunk.items()}
            out = jax.device_get(self._forward(self.params, placed))
            outs.append(jax.tree.map(lambda x, m=m: np.asarray(x)[:m], out))
        return jax.tree.map(lambda *xs: np.concatenate(xs), *outs)

    # ------------------------------------------------------------------------------- host
    def preprocess(self, image: np.ndarray, size: tuple[int, int] | None = None) -> dict[str, np.ndarray]:
        """Model inputs of one uint8 RGB ``image``; ``size`` (h, w) of the full image when ``image``
        was decoded at a reduced scale (JPEG draft), as in evaluation."""
        image = as_rgb(image)
        h, w = size or image.shape[:2]
        ex: dict[str, Any] = {"image": image}
        if self.kind == "detection":
            ex.update(mask=np.ones(image.shape[:2], np.uint8), boxes=np.zeros((0, 4), np.float32),
                      labels=np.zeros((0,), np.int32), is_crowd=np.zeros((0,), np.int32),
                      area=np.zeros((0,), np.float32), image_id=np.int64(0),
                      orig_size=np.asarray([w, h], np.float32))
        elif self.keep_aspect:
            ex["mask"] = np.zeros((h, w), np.uint8)  # the letterbox follows the full size (geometry.full_size)
        for op in self._ops:
            ex = op.map(ex)
        out = {"image": np.asarray(ex["image"], np.float32)}
        if self.kind == "detection":
            out["pad_mask"] = ex["pad_mask"]
            out["content_size"] = ex["content_size"]
        return out

    def predict(self, images: Sequence[np.ndarray], sizes: Sequence[tuple[int, int] | None] | None = None
                ) -> list[Prediction]:
        """Predictions of uint8 RGB ``images`` (any sizes), each at its full size ``sizes[i]`` (h, w)
        (default: the array's own)."""
        sizes = list(sizes) if sizes is not None else [None] * len(images)
        full = [s or np.asarray(im).shape[:2] for im, s in zip(images, sizes)]
        prepped = [self.preprocess(im, s) for im, s in zip(images, sizes)]
        if not prepped:
            return []
        keys = ("image", "pad_mask") if self.kind == "detection" else ("image",)
        out = self.run_batch({k: np.stack([p[k] for p in prepped]) for k in keys})
        preds = []
        for i, (h, w) in enumerate(full):
            h, w = int(h), int(w)
            if self.kind == "segmentation":
                preds.append(self._segmentation(out[i], h, w))
            elif self.kind == "classification":
                preds.append(Prediction(w, h, heads={hd: out[k][i] for k, hd in enumerate(self.task.heads)}))
            else:
                preds.append(self._detection({k: v[i] for k, v in out.items()}, prepped[i]["content_size"], h, w))
        return preds

    __call__ = predict

    def _segmentation(self, prob: np.ndarray, h: int, w: int) -> Prediction:
        from jaxrat.data.geometry import letterbox_shape
        from jaxrat.tasks.segmentation_metrics import to_original

        content = letterbox_shape(h, w, self.image_size) if self.keep_aspect else None
        prob = np.asarray(prob, np.float32)
        if prob.ndim == 3:  # class probabilities: each resized, then the most likely class per pixel
            return of_classes(np.stack([to_original(prob[..., k], h, w, content) for k in range(prob.shape[-1])], -1))
        p = to_original(prob, h, w, content)
        return Prediction(w, h, probability=p, mask=p >= self.threshold)

    def _detection(self, out: dict, content_size: np.ndarray, h: int, w: int) -> Prediction:
        from jaxrat.tasks.detection.task import to_original

        norm = to_original(out["boxes"][None], np.asarray(content_size)[None], self.image_size)[0]
        return Prediction(w, h, boxes=norm * np.array([w, h, w, h], np.float32), scores=out["scores"],
                          labels=out["labels"])

    def predict_tiled(self, image: np.ndarray, tile: int, overlap: float = 0.5) -> Prediction:
        """Segmentation at the image's own resolution: ``tile`` x ``tile`` windows overlapping by
        ``overlap``, Gaussian-blended (see :mod:`jaxrat.inference.augment`)."""
        if self.kind != "segmentation":
            raise UserError(f"--tile is for segmentation; this run is {self.kind}: drop --tile.")
        augment.check_tiling(tile, overlap)
        from jaxrat.data.transforms import Normalize

        image = as_rgb(image)
        h, w = image.shape[:2]
        norm = Normalize().map({"image": image})["image"]
        canvas = np.zeros((max(h, tile), max(w, tile), 3), np.float32)  # 0 after normalising: the mean colour
        canvas[:h, :w] = norm
        corners = augment.tiles(h, w, tile, overlap)
        windows = np.stack([canvas[y:y + tile, x:x + tile] for y, x in corners])
        probs = self.run_batch({"image": windows})
        p = augment.blend(h, w, tile, corners, list(probs))
        if p.ndim == 3:  # class probabilities, blended per class
            return of_classes(p)
        return Prediction(w, h, probability=p, mask=p >= self.threshold)


def of_classes(p: np.ndarray) -> Prediction:
    """The prediction of (H, W, C) class probabilities at the image's size: the most likely class per pixel."""
    labels = np.argmax(p, -1).astype(np.uint8)
    return Prediction(p.shape[1], p.shape[0], probability=p.max(-1), mask=labels > 0, labels=labels,
                      class_probabilities=p)


def as_rgb(image: np.ndarray) -> np.ndarray:
    """An array image as uint8 RGB (H, W, 3): grayscale repeated, alpha dropped, floats in [0, 1] scaled."""
    a = np.asarray(image)
    if a.dtype != np.uint8:
        a = np.clip(a * 255.0 if a.dtype.kind == "f" and a.max(initial=0) <= 1 else a, 0, 255).astype(np.uint8)
    if a.ndim == 2:
        a = a[..., None]
    if a.shape[-1] == 1:
        a = np.repeat(a, 3, -1)
    if a.ndim != 3 or a.shape[-1] < 3:
        raise UserError(f"An image array of shape {np.asarray(image).shape}; pass (H, W), (H, W, 1), (H, W, 3) or "
                        f"(H, W, 4) pixels.")
    return np.ascontiguousarray(a[..., :3])
