"""Image classification with one or several label heads (e.g. genus and species), class-weighted.

``config.task``: ``heads`` (label columns of the CSV; ``("label",)`` for a folder per class),
``num_classes`` (0 = from the data), ``loss_weights``, ``class_weights`` ("none", "inverse",
"effective" or a JSON file ``{head: [w_0, w_1, ...]}``), ``effective_beta``, ``label_smoothing``,
``mixup_alpha``, ``cutmix_alpha``, ``top_k``. A batch holds ``image`` (B, H, W, 3) and ``labels``
(B, heads) int32, -1 where a label is missing (left out of that head's loss and metrics); eval
batches also ``valid``.

Metrics per head over the whole eval set, from confusion counts summed across devices and hosts:
top-1, top-k, macro-F1 (over the classes present in the labels or the predictions), balanced
accuracy (mean recall over the classes present in the labels) and the loss.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import ml_collections as mlc
import numpy as np
import optax
from flax import nnx

from jaxrat.runtime.errors import ConfigError
from jaxrat.tasks.base import Batch, EvalAccumulator, host_rows, local_model_config, record_name
from jaxrat.tasks.class_weights import class_weights
from jaxrat.tasks.image_task import ImageTask
from jaxrat.tasks.mixing import mix_batch

PER_HEAD = ("top1", "topk", "macro_f1", "balanced_accuracy", "loss")
# A head whose largest training class has this many times the images of its smallest is warned about
# when no class weights are set.
UNBALANCED = 10


class ClassificationTask(ImageTask):
    """See the module docstring."""

    def __init__(self, config: mlc.ConfigDict) -> None:
        super().__init__(config)
        t = config.task
        self.heads = tuple(str(h) for h in t.heads)
        n = len(self.heads)
        if not n:
            raise ConfigError("config.task.heads is empty; name at least one label column, e.g. ('label',).")
        for field in ("num_classes", "loss_weights"):
            if len(tuple(t[field])) != n:
                raise ConfigError(f"config.task.{field}={tuple(t[field])} has {len(tuple(t[field]))} entries but "
                                  f"config.task.heads={self.heads} has {n}; give one per head.")
        if not 0 <= t.label_smoothing < 1:
            raise ConfigError(f"config.task.label_smoothing={t.label_smoothing}; use a value in [0, 1).")
        self.loss_weights = tuple(float(w) for w in t.loss_weights)
        self.num_classes: tuple[int, ...] = tuple(int(c) for c in t.num_classes)
        self.weights: tuple[np.ndarray, ...] = ()
        self.vocabularies: dict[str, list] = {}

    # ---------------------------------------------------------------------------------- data
    def prepare_data(self, workdir: str) -> str:
        from jaxrat.data.datasets import resolve_classification

        d = self.config.data
        self.train_source, self.val_source, self.vocabularies, found = resolve_classification(
            d, self.heads, workdir, seed=self.config.seed, process_index=jax.process_index())
        self.num_classes = tuple(c or f for c, f in zip(self.num_classes, found))
        for head, c, f in zip(self.heads, self.num_classes, found):
            if c < f:
                raise ConfigError(f"config.task.num_classes gives head {head!r} {c} classes but its labels go up to "
                                  f"{f - 1}; raise it or set 0 to take it from the data.")
        labels = np.stack([r["labels"] for r in self.train_source.records])
        if str(self.config.task.class_weights) == "none":
            for h, head in enumerate(self.heads):
                self._say_unbalanced(head, labels[:, h])
        self.weights = tuple(
            class_weights(labels[:, h], self.num_classes[h], self.config.task.class_weights, head,
                          beta=float(self.config.task.effective_beta))
            for h, head in enumerate(self.heads))
        classes = ", ".join(f"{h}: {c} classes" for h, c in zip(self.heads, self.num_classes))
        return f"{len(self.train_source)} train and {len(self.val_source)} validation images ({classes})"

    def _say_unbalanced(self, head: str, labels: np.ndarray) -> None:
        """Warn when a head's largest training class has UNBALANCED times the images of its smallest and
        no class weights are set: the loss then mostly rewards predicting the large classes."""
        counts = np.bincount(labels[labels >= 0])
        present = np.flatnonzero(counts)
        if len(present) < 2:
            return
        big, small = present[counts[present].argmax()], present[counts[present].argmin()]
        if counts[big] >= UNBALANCED * counts[small]:
            names = self.vocabularies.get(head) or []

            def name(c: int) -> str:
                return repr(str(names[c])) if c < len(names) else str(c)

            logging.warning("data: head %r is unbalanced: %d training images of %s against %d of %s; "
                            "--config.task.class_weights=inverse (or effective) weighs the loss by class, and "
                            "eval/%s/balanced_accuracy scores each class equally.", head, counts[big], name(big),
                            counts[small], name(small), head)

    def label_space(self) -> dict[str, Any]:
        """Each head's class count and names (text labels and class folders; numbers have none)."""
        return {"heads": {h: {"classes": int(c), "names": [str(x) for x in self.vocabularies.get(h) or []]}
                          for h, c in zip(self.heads, self.num_classes)}}

    def use_label_space(self, saved: dict[str, Any]) -> None:
        heads = saved["heads"]
        self.vocabularies = {h: list(heads[h]["names"]) for h in self.heads}
        self.num_classes = tuple(int(heads[h]["classes"]) for h in self.heads)

    def build_model(self, *, dtype: Any, rngs: nnx.Rngs, kernels: Any) -> nnx.Module:
        from jaxrat.models import build_model

        model_config = mlc.ConfigDict(local_model_config(self.config.model).to_dict())
        model_config.num_classes = tuple(self.num_classes)
        return build_model(model_config, dtype=dtype, rngs=rngs, kernels=kernels)

    # ------------------------------------------------------------------------- inside jit
    def _head_losses(self, logits: Sequence[jax.Array], labels: jax.Array, ok: jax.Array,
                     mix: tuple[jax.Array, jax.Array] | None) -> list[tuple[jax.Array, jax.Array]]:
        """Per head (sum of weighted cross-entropies, sum of weights) over the batch."""
        out = []
        eps = float(self.config.task.label_smoothing)
        for h, lg in enumerate(logits):
            c = self.num_classes[h]
            y = labels[:, h]
            has = ok & (y >= 0)
            yc = jnp.maximum(y, 0)
            target = optax.smooth_labels(jax.nn.one_hot(yc, c), eps) if eps else jax.nn.one_hot(yc, c)
            w = jnp.asarray(self.weights[h])[yc]
            if mix is not None:
                lam, perm = mix
                has = has & has[perm]
                target = lam * target + (1 - lam) * target[perm]
                w = lam * w + (1 - lam) * w[perm]
            w = w * has
            ce = optax.softmax_cross_entropy(lg.astype(jnp.float32), target)
            out.append(((w * ce).sum(), w.sum()))
        return out

    def loss(self, model: nnx.Module, batch: Batch, rng: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        t = self.config.task
        images, mix = mix_batch(batch["image"], rng, float(t.mixup_alpha), float(t.cutmix_alpha))
        logits = model(images)
        ok = jnp.ones(batch["labels"].shape[0], bool)
        total, parts = jnp.zeros(()), {}
        for h, (num, den) in enumerate(self._head_losses(logits, batch["labels"], ok, mix)):
            head_loss = num / jnp.maximum(den, 1e-12)
            parts[f"{self.heads[h]}/loss"] = head_loss
            total = total + self.loss_weights[h] * head_loss
        return total, parts

    def eval_step(self, model: nnx.Module, batch: Batch) -> tuple[dict[str, jax.Array], Any]:
        logits = model(batch["image"])
        valid = batch["valid"] > 0
        sums: dict[str, jax.Array] = {}
        k = int(self.config.task.top_k)
        preds = []
        for h, ((num, den), lg) in enumerate(zip(self._head_losses(logits, batch["labels"], valid, None), logits)):
            c, y = self.num_classes[h], batch["labels"][:, h]
            has = (valid & (y >= 0)).astype(jnp.float32)
            pred = jnp.argmax(lg, -1)
            preds.append(pred.astype(jnp.int32))
            onehot_y = jax.nn.one_hot(jnp.maximum(y, 0), c) * has[:, None]
            name = self.heads[h]
            sums[f"{name}/confusion"] = onehot_y.T @ jax.nn.one_hot(pred, c)
            top = jax.lax.top_k(lg, min(k, c))[1]
            sums[f"{name}/topk_hits"] = ((top == y[:, None]).any(-1) * has).sum()
            sums[f"{name}/loss_sum"], sums[f"{name}/weight_sum"] = num, den
        return sums, jnp.stack(preds, -1)  # (B, heads): the predicted classes, for per-image results

    # ----------------------------------------------------------------------------- host side
    def new_eval(self) -> EvalAccumulator:
        def label(h: int, c: int) -> str:
            names = self.vocabularies.get(self.heads[h]) or []
            return str(names[c]) if 0 <= c < len(names) else ("" if c < 0 else str(c))

        return _ClassificationEval(self.heads, bool(self.config.train.log_images),
                                   name=lambda i: record_name(self.val_source.records[i], i), label=label)

    @property
    def metric_names(self) -> tuple[str, ...]:
        return tuple(f"{h}/{m}" for h in self.heads for m in PER_HEAD) + ("loss",)


def head_metrics(confusion: np.ndarray, topk_hits: float) -> dict[str, float]:
    """top1, topk, macro_f1 and balanced_accuracy from a (true, predicted) confusion matrix."""
    confusion = np.asarray(confusion, np.float64)
    n = confusion.sum()
    tp = np.diag(confusion)
    support, predicted = confusion.sum(1), confusion.sum(0)
    present = (support > 0) | (predicted > 0)
    f1 = np.divide(2 * tp, support + predicted, out=np.zeros_like(tp), where=(support + predicted) > 0)
    recall = np.divide(tp, support, out=np.zeros_like(tp), where=support > 0)
    return {
        "top1": tp.sum() / n if n else 0.0,
        "topk": topk_hits / n if n else 0.0,
        "macro_f1": float(f1[present].mean()) if present.any() else 0.0,
        "balanced_accuracy": float(recall[support > 0].mean()) if (support > 0).any() else 0.0,
    }


class _ClassificationEval(EvalAccumulator):
    def __init__(self, heads: tuple[str, ...], log_images: bool, name: Any = str, label: Any = None) -> None:
        super().__init__()
        self.heads, self.log_images = heads, log_images
        self._confusions: dict[str, np.ndarray] = {}
        self._name, self._label = name, label or (lambda h, c: str(c))
        self._rows: list[np.ndarray] = []  # (valid, labels..., predictions...) per example, this process's

    def update(self, sums: Mapping[str, jax.Array], batch: Batch, outputs: Any) -> None:
        self.add_sums(sums)
        if outputs is not None:
            self._rows.append(np.concatenate([np.asarray(batch["valid"]).reshape(-1, 1).astype(np.int32),
                                              np.asarray(batch["labels"], np.int32), host_rows(outputs)], 1))

    def per_image(self) -> list[dict[str, Any]]:
        """True and predicted label per head of every eval image, in the split's order."""
        n = len(self.heads)
        local = np.concatenate(self._rows) if self._rows else np.zeros((0, 1 + 2 * n), np.int32)
        count = jax.process_count()
        if count > 1:
            from jax.experimental import multihost_utils

            rows = np.asarray(multihost_utils.process_allgather(local, tiled=True)).reshape(count, len(local), -1)
            # Process p read elements p, p + P, p + 2P, ... of the (padded) split.
            local = rows.transpose(1, 0, 2).reshape(-1, rows.shape[-1])
        out = []
        for i, r in enumerate(local.tolist()):
            if not r[0]:
                continue
            row: dict[str, Any] = {"image": self._name(i)}
            for h, head in enumerate(self.heads):
                true, pred = r[1 + h], r[1 + n + h]
                row[f"{head}/true"] = self._label(h, true)
                row[f"{head}/predicted"] = self._label(h, pred)
                row[f"{head}/correct"] = int(true == pred) if true >= 0 else ""
            out.append(row)
        return out

    def finalize(self) -> dict[str, float]:
        totals = jax.device_get(self.totals)
        out: dict[str, float] = {}
        loss = 0.0
        for h in self.heads:
            conf = np.asarray(totals[f"{h}/confusion"], np.float64)
            self._confusions[h] = conf
            for k, v in head_metrics(conf, float(totals[f"{h}/topk_hits"])).items():
                out[f"{h}/{k}"] = float(v)
            out[f"{h}/loss"] = float(totals[f"{h}/loss_sum"]) / max(float(totals[f"{h}/weight_sum"]), 1e-12)
            loss += out[f"{h}/loss"]
        out["loss"] = loss / len(self.heads)
        return out

    def confusions(self) -> dict[str, tuple[np.ndarray, list[str]]]:
        """Each head's last confusion matrix (true x predicted counts) and its class names."""
        return {head: (conf, [self._label(self.heads.index(head), c) for c in range(conf.shape[0])])
                for head, conf in self._confusions.items()}

    def images(self) -> dict[str, np.ndarray]:
        """Each head's confusion matrix, rows normalised (true class), as a grey image."""
        if not self.log_images:
            return {}
        images = {}
        for h, conf in self._confusions.items():
            rows = conf / np.maximum(conf.sum(1, keepdims=True), 1)
            scale = max(1, 128 // max(conf.shape[0], 1))
            img = np.kron(rows, np.ones((scale, scale)))
            images[f"eval/{h}/confusion"] = np.repeat(img[None, ..., None], 3, -1)
        return images

