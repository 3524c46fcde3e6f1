"""The Task interface: everything the trainer must not know about a problem.

A task owns its data (what a batch holds and the iterators that make batches), the model it
trains, its loss (the loss and any number of named parts), its eval accumulators and metrics, the
images it logs, and the metric names a checkpoint policy may rank by. The trainer handles
devices, steps, optimizers, checkpoints and logs, and never names a batch field or a metric.

Jitted pieces (:meth:`Task.loss`, :meth:`Task.eval_step`) take a Flax NNX model and a batch of
global arrays; host pieces take numpy. A task is chosen by ``config.task.name``: a built-in name
(:data:`BUILTIN_TASKS`) or ``"package.module:ClassName"`` for a task of the user's own.
"""

from __future__ import annotations

import abc
import importlib
import os
from typing import Any, Iterable, Iterator, Mapping

import jax
import ml_collections as mlc
import numpy as np
from flax import nnx

from jaxrat.checkpointing.hub import is_hub, resolve_pretrained
from jaxrat.runtime.errors import ConfigError

Batch = Mapping[str, Any]
# Under ``train.reduction_shards`` the batch :meth:`Task.loss` gets is one fixed shard, and this key
# holds :meth:`Task.batch_totals` of the whole (micro-)batch divided by the number of shards.
SHARD_TOTALS = "shard_totals"

BUILTIN_TASKS = {
    "segmentation": "jaxrat.tasks.segmentation:SegmentationTask",
    "classification": "jaxrat.tasks.classification:ClassificationTask",
    "detection": "jaxrat.tasks.detection.task:DetectionTask",
}


class EvalAccumulator(abc.ABC):
    """One pass over an eval split: adds up what :meth:`Task.eval_step` returned, then metrics.

    ``sums`` are dicts of scalars already reduced over every device and host (inside jit); add
    them on the device and fetch once at the end. Whatever needs the examples themselves
    (COCOeval on boxes, images to log) uses :func:`host_rows` on the outputs.
    """

    def __init__(self) -> None:
        self.totals: dict[str, jax.Array] | None = None

    def add_sums(self, sums: Mapping[str, jax.Array]) -> None:
        """Add one batch's replicated sums to the running totals (no host transfer)."""
        self.totals = dict(sums) if self.totals is None else {k: self.totals[k] + v for k, v in sums.items()}

    def update(self, sums: Mapping[str, jax.Array], batch: Batch, outputs: Any) -> None:
        """Take one eval batch: ``batch`` is this process's numpy batch, ``outputs`` global arrays."""
        self.add_sums(sums)

    def fetched_totals(self) -> dict[str, float]:
        """The totals as host floats (float64), {} when no batch was seen."""
        if self.totals is None:
            return {}
        return {k: float(np.asarray(v, np.float64)) for k, v in jax.device_get(self.totals).items()}

    @abc.abstractmethod
    def finalize(self) -> dict[str, float]:
        """Metrics over the whole split, by name without the ``eval/`` prefix. Every process calls
        it (it may run collectives, e.g. to gather predictions) and gets the same numbers."""

    def images(self) -> dict[str, np.ndarray]:
        """Images to log, ``{name: (N, H, W, 3) floats in [0, 1]}``; {} for none."""
        return {}

    def per_image_summary(self) -> dict[str, Any]:
        """After :meth:`finalize`: split-level results beside the per-image rows (e.g. each
        category's AP), merged into ``metrics.json`` by ``jaxrat.evaluate``; {} for none."""
        return {}

    def per_image(self) -> list[dict[str, Any]]:
        """After :meth:`finalize`: one row per eval example (``image`` first, then the task's
        columns), every process's, in example order; [] when the task keeps none."""
        return []


class Task(abc.ABC):
    """A problem to train on: data, model, loss, metrics. See the module docstring.

    The trainer traces its sharded step under ``jax.set_mesh``: per-device work inside the loss
    (e.g. matching under ``shard_map``) finds the mesh with ``jax.sharding.get_abstract_mesh()``,
    which is empty when the loss runs in a single-device program (``train.reduction_shards``).
    """

    # The classes whose curves the run summary draws beside the overall ones (e.g. a multi-class
    # segmentation's foreground classes); none by default.
    curve_classes: tuple[str, ...] = ()

    def __init__(self, config: mlc.ConfigDict) -> None:
        self.config = config

    # ---------------------------------------------------------------------------------- data
    @abc.abstractmethod
    def prepare_data(self, workdir: str) -> str:
        """Find (or generate, or stage) the data before any iterator is made; return a short
        description for the log, e.g. "256 train and 64 validation images"."""

    def label_space(self) -> dict[str, Any] | None:
        """What each output means once the data is prepared, as JSON (kept as ``WORKDIR/labels.json``
        for predict and export, and checked when the run is resumed or evaluated); None when the
        config says it all (the default)."""
        return None

    def use_label_space(self, saved: dict[str, Any]) -> None:
        """Take the labels of a :meth:`label_space` a run saved instead of preparing the data."""
        raise NotImplementedError(f"{type(self).__name__} saves no label space")

    def num_train_examples(self) -> int:
        """Examples in one epoch of the training set once prepared (0: unknown), for the progress line."""
        source = getattr(self, "train_source", None)
        return len(source) if source is not None else 0

    @abc.abstractmethod
    def train_iterator(self, start_example: int, *, local_batch: int, process_index: int, process_count: int,
                       processes_on_host: int) -> Iterator[dict[str, np.ndarray]]:
        """This process's share of the global training stream from global example ``start_example``.

        Batches are dicts of numpy arrays with a leading ``local_batch`` dimension. The iterator
        must have ``get_state() -> bytes`` and ``set_state(bytes)`` (Grain's checkpoint protocol) so
        the trainer can checkpoint the position, and ``close()`` if it holds resources.
        """

    @abc.abstractmethod
    def eval_batches(self, *, global_batch: int, process_index: int,
                     process_count: int) -> Iterable[dict[str, np.ndarray]]:
        """This process's share of every eval batch, in the same number of batches on every
        process (padded; the task marks padding itself and leaves it out of its sums)."""

    # --------------------------------------------------------------------------------- model
    def build_model(self, *, dtype: Any, rngs: nnx.Rngs, kernels: Any) -> nnx.Module:
        """The model to train; by default ``config.model`` through the model registry.

        ``kernels`` is the run's kernel policy (:class:`jaxrat.ops.KernelPolicy`, resolved once from
        the mesh's platform by the trainer); pass it on to the model.
        """
        from jaxrat.models import build_model

        return build_model(local_model_config(self.config.model), dtype=dtype, rngs=rngs, kernels=kernels)

    # ------------------------------------------------------------------------- inside jit
    @abc.abstractmethod
    def loss(self, model: nnx.Module, batch: Batch, rng: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        """(scalar loss, named scalars to log as ``train/<name>``) for one (micro-)batch.

        ``rng`` is this micro-batch's key (from the seed and the step) for randomness the task
        applies inside the step, e.g. mixup; the model's dropout has its own streams.

        The named scalars are averaged over micro-batches like the loss, so anything that is a
        mean over the batch (loss parts, a data fingerprint) may go there.
        """

    def batch_totals(self, batch: Batch) -> dict[str, jax.Array]:
        """Sums over the whole (micro-)batch that :meth:`loss` divides by (DETR's number of boxes).

        Only used under ``train.reduction_shards``, where :meth:`loss` sees one shard at a time and
        finds these sums, divided by the number of shards, in ``batch[SHARD_TOTALS]``; the step
        averages the shards' losses, so dividing by them divides by the whole batch's sum. Default:
        none (a loss that is a mean over its rows needs none).
        """
        return {}

    @abc.abstractmethod
    def eval_step(self, model: nnx.Module, batch: Batch) -> tuple[dict[str, jax.Array], Any]:
        """(sums over the batch's real examples, per-example outputs) of one eval batch.

        The sums come out replicated (reduced over every device and host by XLA); the outputs
        keep the batch sharding and are handed to :meth:`EvalAccumulator.update`.
        """

    # ----------------------------------------------------------------------------- host side
    @abc.abstractmethod
    def new_eval(self) -> EvalAccumulator:
        """A fresh accumulator for one pass over the eval split."""

    @property
    @abc.abstractmethod
    def metric_names(self) -> tuple[str, ...]:
        """Names (without ``eval/``) that :meth:`EvalAccumulator.finalize` returns, in log order;
        ``config.checkpoint.best_metric`` must be ``eval/`` plus one of them."""


def host_rows(x: jax.Array) -> np.ndarray:
    """This process's rows of a batch-sharded global array, in the order of its local batch.

    Every addressable shard is read (not only the first device's), so a process with several
    devices gets all of its rows; replicated copies are taken once.
    """
    shards = {}
    for s in x.addressable_shards:
        start = (s.index[0].start or 0) if s.index else 0
        shards.setdefault(start, s.data)
    return np.concatenate([np.asarray(shards[k]) for k in sorted(shards)], axis=0)


def record_name(record: Any, index: int) -> str:
    """A short name of an eval record for per-image results: its image file's name."""
    first = record[0] if isinstance(record, (tuple, list)) else record
    if isinstance(first, dict):
        first = first.get("path") or first.get("id") or first.get("name") or index
    return os.path.basename(str(getattr(first, "name", first)))  # a path, or in-memory bytes' name


def load_task(config: mlc.ConfigDict) -> Task:
    """The task named by ``config.task.name``: a built-in name or ``"package.module:ClassName"``."""
    name = str(config.task.name)
    target = BUILTIN_TASKS.get(name, name)
    module_name, sep, class_name = target.partition(":")
    if not sep or not module_name or not class_name:
        raise ConfigError(
            f"config.task.name={name!r} is neither a built-in task ({', '.join(sorted(BUILTIN_TASKS))}) nor "
            f"'package.module:ClassName'; use one of those."
        )
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):
            raise ConfigError(
                f"config.task.name={name!r}: module {module_name} cannot be imported; check the name and that "
                f"its folder is on PYTHONPATH."
            ) from None
        raise
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise ConfigError(f"config.task.name={name!r}: {module_name} has no Task subclass {class_name}; "
                          f"name a class derived from jaxrat.tasks.base.Task.")
    return cls(config)


def local_model_config(model_config: mlc.ConfigDict) -> mlc.ConfigDict:
    """``model_config`` with a hub ``pretrained`` (``hf:OWNER/NAME[@REV]``) replaced by its local
    folder in the Hugging Face cache (downloaded if needed), so that the model is built from the
    architecture its ``config.json`` states; any other value is returned unchanged (not copied)."""
    pretrained = str(model_config.get("pretrained", "") or "")
    if not is_hub(pretrained):
        return model_config
    local = mlc.ConfigDict(model_config.to_dict())
    local.pretrained = resolve_pretrained(pretrained)
    return local
