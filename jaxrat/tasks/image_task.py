"""Tasks whose data are image examples read through jaxrat's Grain pipeline (segmentation,
classification, ...): the iterators come from the two example sources ``prepare_data`` found."""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import numpy as np

from jaxrat.tasks.base import Task


class ImageTask(Task):
    """A :class:`Task` whose ``prepare_data`` sets ``self.train_source`` and ``self.val_source``
    (:class:`jaxrat.data.pipeline.ExampleSource`); batching, augmentation (``config.data``) and the
    per-host split follow :mod:`jaxrat.data.pipeline`."""

    train_source: Any = None
    val_source: Any = None

    def train_iterator(self, start_example: int, *, local_batch: int, process_index: int, process_count: int,
                       processes_on_host: int) -> Iterator[dict[str, np.ndarray]]:
        from jaxrat.data import pipeline

        d = self.config.data
        return pipeline.train_iterator(
            self.train_source, image_size=d.image_size, local_batch=local_batch, seed=self.config.seed,
            process_index=process_index, process_count=process_count, start_example=start_example,
            processes_on_host=processes_on_host, **pipeline.train_options(d))

    def eval_batches(self, *, global_batch: int, process_index: int,
                     process_count: int) -> Iterable[dict[str, np.ndarray]]:
        from jaxrat.data import pipeline

        d = self.config.data
        return pipeline.eval_batches(self.val_source, image_size=d.image_size, global_batch=global_batch,
                                     process_index=process_index, process_count=process_count,
                                     **pipeline.eval_options(d))
