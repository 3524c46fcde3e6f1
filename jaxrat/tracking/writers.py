"""Metric writers: console (every process), TensorBoard + metrics.jsonl (process 0 only).

TensorBoard files are written with tensorboardX rather than clu.metric_writers, which imports
TensorFlow (+1.4 GB, +6 s per start) for nothing else. Logs are not worth a training run: a write
that fails (disk full, quota, a vanished network mount) costs a warning, and ``metrics.jsonl``
never keeps half a line.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any, Callable, Mapping

import numpy as np


class MetricWriter:
    """Writes scalars and images under ``workdir``; only process 0 touches files."""

    def __init__(self, workdir: str, *, is_main: bool):
        self.is_main = is_main
        self._tb = None
        self._fd: int | None = None
        self._path = os.path.join(workdir, "metrics.jsonl")
        self._failing: set[str] = set()
        if is_main:
            from tensorboardX import SummaryWriter  # imported lazily: only process 0 needs it

            self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))
            self._fd = os.open(self._path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def _guard(self, what: str, write: Callable[[], Any]) -> None:
        try:
            write()
        except OSError as e:
            if what not in self._failing:
                logging.warning("%s: cannot write (%s); training goes on, and these logs resume once writing works",
                                what, e.strerror or e)
            self._failing.add(what)
            return
        if what in self._failing:
            logging.warning("%s: writing again", what)
            self._failing.discard(what)

    def _append_line(self, line: str) -> None:
        """One ``write`` per line; a partial one (disk full midway) is cut back off."""
        data = line.encode()
        start = os.lseek(self._fd, 0, os.SEEK_END)
        written = os.write(self._fd, data)
        if written < len(data):
            os.ftruncate(self._fd, start)
            raise OSError(28, "No space left on device")

    def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        """One JSON line ``{"step": step, name: value, ...}`` and one TensorBoard scalar per name."""
        if not self.is_main:
            return
        clean = {k: float(v) for k, v in scalars.items()}
        line = json.dumps({"step": int(step), "time": time.time(), **clean}) + "\n"
        self._guard(self._path, lambda: self._append_line(line))
        for k, v in clean.items():
            self._guard("tensorboard", lambda: self._tb.add_scalar(k, v, int(step)))

    def write_images(self, step: int, images: Mapping[str, np.ndarray]) -> None:
        """Images as (N, H, W, C) floats in [0, 1]."""
        if not self.is_main:
            return
        for k, v in images.items():
            self._guard("tensorboard", lambda: self._tb.add_images(k, np.clip(np.asarray(v), 0, 1), int(step),
                                                                   dataformats="NHWC"))

    def flush(self) -> None:
        """Push buffered events to disk."""
        if self.is_main:
            self._guard("tensorboard", self._tb.flush)

    def close(self) -> None:
        """Flush and close files."""
        if self.is_main:
            self._guard("tensorboard", self._tb.close)
            os.close(self._fd)


def format_progress(step: int, total: int, scalars: Mapping[str, float], elapsed: float, done: int) -> str:
    """``step 120/400 (30%) loss 0.3121 lr 2.9e-03 8.10 steps/s 130 ex/s ETA 00:00:34``.

    Steps/s and examples/s are those of the last logging window (``scalars``); the ETA uses the mean
    rate since this run started (``done`` steps in ``elapsed`` seconds), compilation included."""
    rate = done / elapsed if elapsed > 0 else 0.0
    eta = (total - step) / rate if rate > 0 else float("nan")
    eta_s = time.strftime("%H:%M:%S", time.gmtime(eta)) if np.isfinite(eta) else "?"
    parts = [f"step {step}/{total} ({100 * step / max(total, 1):.0f}%)"]
    if "train/loss" in scalars:
        parts.append(f"loss {scalars['train/loss']:.4f}")
    if "train/learning_rate" in scalars:
        parts.append(f"lr {scalars['train/learning_rate']:.1e}")
    parts.append(f"{scalars.get('train/steps_per_sec', rate):.2f} steps/s")
    if "train/examples_per_sec" in scalars:
        parts.append(f"{scalars['train/examples_per_sec']:.0f} ex/s")
    parts.append(f"ETA {eta_s}")
    return " ".join(parts)
