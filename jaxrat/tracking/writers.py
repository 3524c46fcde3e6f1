"""The run's metric writer: console progress (every process) and the trackers (process 0 only).

:class:`MetricWriter` fans each call out to the trackers chosen by ``config.tracking.backends``
(``tensorboard``, ``jsonl``, ``mlflow``, ``wandb``). Logs are not worth a training run: a tracker
that fails (disk full, quota, a vanished mount, a server that went away) costs a warning and is
tried again at its next call, ``metrics.jsonl`` never keeps half a line, and network trackers
work in their own thread so a dead server never stalls a step.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Mapping, Sequence

import numpy as np

from jaxrat.runtime.errors import ConfigError, UserError
from jaxrat.tracking.base import Guard, Tracker, describe, flatten

DEFAULT_BACKENDS = ("tensorboard", "jsonl")
BACKENDS = ("tensorboard", "jsonl", "mlflow", "wandb")
WANDB_MODES = ("offline", "online", "disabled")


def _setting(tracking: Any, key: str, default: Any) -> Any:
    return tracking.get(key, default) if tracking is not None else default


def check_tracking(tracking: Any) -> None:
    """Before training starts: every backend is known and its package installed (one sentence if not)."""
    import importlib.util

    backends = tuple(_setting(tracking, "backends", DEFAULT_BACKENDS))
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        raise ConfigError(f"config.tracking.backends={backends!r} names unknown backends {unknown}; "
                          f"choose from {BACKENDS}.")
    mode = _setting(tracking, "wandb_mode", "offline")
    if "wandb" in backends and mode not in WANDB_MODES:
        raise ConfigError(f"config.tracking.wandb_mode={mode!r}; use one of {WANDB_MODES}.")
    for name in ("mlflow", "wandb"):
        if name in backends and importlib.util.find_spec(name) is None:
            raise ConfigError(f"config.tracking.backends includes {name!r} but the {name} package is not installed; "
                              f"run pip install 'jaxrat[tracking]'.")


def open_trackers(workdir: str, tracking: Any = None) -> list[Tracker]:
    """The trackers ``tracking.backends`` names (``tracking``: a ``config.tracking`` section or None).

    A backend whose package is missing is a :class:`ConfigError`; one that cannot start (its folder
    cannot be written) costs a warning and is left out.
    """
    check_tracking(tracking)
    backends = tuple(_setting(tracking, "backends", DEFAULT_BACKENDS))
    trackers: list[Tracker] = []
    for name in dict.fromkeys(backends):
        try:
            trackers.append(_open(name, workdir, tracking))
        except UserError:
            raise
        except Exception as e:  # a tracker that cannot start is not worth the run either
            logging.warning("%s: cannot start (%s); training goes on without it", name, describe(e))
    return trackers


def _open(name: str, workdir: str, tracking: Any) -> Tracker:
    if name == "tensorboard":
        from jaxrat.tracking.tensorboard import TensorBoardTracker

        return TensorBoardTracker(workdir)
    if name == "jsonl":
        from jaxrat.tracking.jsonl import JsonlTracker

        return JsonlTracker(workdir)
    if name == "mlflow":
        from jaxrat.tracking.mlflow import MLflowTracker

        return MLflowTracker(workdir, tracking)
    from jaxrat.tracking.wandb import WandbTracker

    return WandbTracker(workdir, tracking)


class MetricWriter:
    """Sends scalars, images, the config and the run's files to every tracker; only process 0 has any."""

    def __init__(self, workdir: str, *, is_main: bool, tracking: Any = None,
                 trackers: Sequence[Tracker] | None = None) -> None:
        self.is_main = is_main
        self._guard = Guard()
        if not is_main:
            self.trackers: list[Tracker] = []
        elif trackers is not None:
            self.trackers = list(trackers)
        else:
            self.trackers = open_trackers(workdir, tracking)

    def _each(self, call: str, *args: Any) -> None:
        for t in self.trackers:
            self._guard.call(t.name, lambda t=t: getattr(t, call)(*args))

    def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        """One JSON line ``{"step": step, name: value, ...}``, and one scalar per name in every other tracker."""
        self._each("log_scalars", int(step), {k: float(v) for k, v in scalars.items()})

    def write_images(self, step: int, images: Mapping[str, np.ndarray]) -> None:
        """Images as (N, H, W, C) floats in [0, 1]."""
        self._each("log_images", int(step), images)

    def write_hparams(self, config: Mapping[str, Any]) -> None:
        """The run's config (nested dicts), flattened to ``{"optimizer.learning_rate": 1e-3, ...}``."""
        self._each("log_hparams", flatten(config))

    def log_artifact(self, path: str) -> None:
        """A small file the run wrote (its summary)."""
        self._each("log_artifact", path)

    def log_reference(self, name: str, path: str) -> None:
        """A large thing the run wrote (a checkpoint), named by its path."""
        self._each("log_reference", name, path)

    def flush(self) -> None:
        """Push buffered events."""
        self._each("flush")

    def close(self, status: str = "finished") -> None:
        """End every tracker's run (``status``: "finished", "failed", "preempted" or "interrupted")."""
        self._each("close", status)
        self.trackers = []


def format_progress(step: int, total: int, scalars: Mapping[str, float], elapsed: float, done: int,
                    epoch: float | None = None, bar: bool = False) -> str:
    """``epoch 2.40 step 120/400 (30%) loss 0.3121 lr 2.9e-03 8.10 steps/s 130 ex/s ETA 00:00:34``.

    Steps/s and examples/s are those of the last logging window (``scalars``); the ETA uses the mean
    rate since this run started (``done`` steps in ``elapsed`` seconds), compilation included.
    ``epoch``: passes over the training set so far (None: unknown); ``bar``: a ``[####    ]`` bar first."""
    rate = done / elapsed if elapsed > 0 else 0.0
    eta = (total - step) / rate if rate > 0 else float("nan")
    eta_s = time.strftime("%H:%M:%S", time.gmtime(eta)) if np.isfinite(eta) else "?"
    parts = [f"[{'#' * int(20 * step / max(total, 1)):<20}]"] if bar else []
    parts += [f"epoch {epoch:.2f}"] if epoch is not None else []
    parts += [f"step {step}/{total} ({100 * step / max(total, 1):.0f}%)"]
    if "train/loss" in scalars:
        parts.append(f"loss {scalars['train/loss']:.4f}")
    if "train/learning_rate" in scalars:
        parts.append(f"lr {scalars['train/learning_rate']:.1e}")
    parts.append(f"{scalars.get('train/steps_per_sec', rate):.2f} steps/s")
    if "train/examples_per_sec" in scalars:
        parts.append(f"{scalars['train/examples_per_sec']:.0f} ex/s")
    parts.append(f"ETA {eta_s}")
    return " ".join(parts)
