"""TensorBoard event files under ``WORKDIR/tensorboard``, written with tensorboardX.

tensorboardX rather than clu.metric_writers, which imports TensorFlow (+1.4 GB, +6 s per start)
for nothing else.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Iterator, Mapping

import numpy as np

from jaxrat.tracking.base import TrackerBase


@contextlib.contextmanager
def _without_torch() -> Iterator[None]:
    """Import tensorboardX as if PyTorch were absent: its writer imports torch when it can only to
    accept torch tensors, which we never pass, and that import is ~1 s of every run's start where
    torch is installed (the reference extra). A process that already imported torch keeps it."""
    blocked = "torch" not in sys.modules
    if blocked:
        sys.modules["torch"] = None  # type: ignore[assignment]  # "import torch" raises ImportError
    try:
        yield
    finally:
        if blocked and sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]


class TensorBoardTracker(TrackerBase):
    """Scalars, images, and the config (HParams dashboard + a text table)."""

    name = "tensorboard"

    def __init__(self, workdir: str) -> None:
        with _without_torch():
            from tensorboardX import SummaryWriter  # imported lazily: only process 0 needs it

        self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        for k, v in scalars.items():
            self._tb.add_scalar(k, v, int(step))

    def log_images(self, step: int, images: Mapping[str, np.ndarray]) -> None:
        for k, v in images.items():
            self._tb.add_images(k, np.clip(np.asarray(v), 0, 1), int(step), dataformats="NHWC")

    def log_hparams(self, hparams: Mapping[str, Any]) -> None:
        from tensorboardX.summary import hparams as hparams_summary

        # In this run's own event file (add_hparams would start another run folder), so the HParams
        # dashboard lists the run's config beside its scalars.
        clean = {k: ("" if v is None else v) for k, v in hparams.items()}
        for summary in hparams_summary(clean, {}):
            self._tb.file_writer.add_summary(summary)
        table = "\n".join(f"| {k} | {v} |" for k, v in sorted(hparams.items()))
        self._tb.add_text("config", "| key | value |\n|---|---|\n" + table, 0)

    def log_reference(self, name: str, path: str) -> None:
        self._tb.add_text(name, path, 0)

    def flush(self) -> None:
        self._tb.flush()

    def close(self, status: str = "finished") -> None:
        self._tb.close()
