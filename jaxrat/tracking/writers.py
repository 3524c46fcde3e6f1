"""Metric writers: console (every process), TensorBoard + metrics.jsonl (process 0 only).

TensorBoard files are written with tensorboardX rather than clu.metric_writers, which imports
TensorFlow (+1.4 GB, +6 s per start) for nothing else.
"""

from __future__ import annotations

import json
import os
import time
from typing import Mapping

import numpy as np


class MetricWriter:
    """Writes scalars and images under ``workdir``; only process 0 touches files."""

    def __init__(self, workdir: str, *, is_main: bool):
        self.is_main = is_main
        self._tb = None
        self._jsonl = None
        if is_main:
            from tensorboardX import SummaryWriter  # imported lazily: only process 0 needs it

            self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))
            self._jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a", buffering=1)

    def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        """One JSON line ``{"step": step, name: value, ...}`` and one TensorBoard scalar per name."""
        if not self.is_main:
            return
        clean = {k: float(v) for k, v in scalars.items()}
        self._jsonl.write(json.dumps({"step": int(step), "time": time.time(), **clean}) + "\n")
        for k, v in clean.items():
            self._tb.add_scalar(k, v, int(step))

    def write_images(self, step: int, images: Mapping[str, np.ndarray]) -> None:
        """Images as (N, H, W, C) floats in [0, 1]."""
        if not self.is_main:
            return
        for k, v in images.items():
            self._tb.add_images(k, np.clip(np.asarray(v), 0, 1), int(step), dataformats="NHWC")

    def flush(self) -> None:
        """Push buffered events to disk."""
        if self.is_main:
            self._tb.flush()
            self._jsonl.flush()

    def close(self) -> None:
        """Flush and close files."""
        if self.is_main:
            self._tb.close()
            self._jsonl.close()


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
