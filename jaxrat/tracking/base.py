"""The tracker interface, and the guard that keeps a failing tracker from costing the training run.

A tracker receives what the loop logs: scalars per step, images, the hyper-parameters once, small
files the run wrote (artifacts) and paths to big things it should only name (references, e.g.
checkpoints). Only process 0 builds trackers (see :mod:`jaxrat.tracking.writers`).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Protocol

import numpy as np

from jaxrat.runtime import dotted


class Tracker(Protocol):
    """What every tracking backend implements; unneeded calls may do nothing (see :class:`TrackerBase`)."""

    name: str

    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        """``{"train/loss": 0.3, ...}`` at ``step``."""

    def log_images(self, step: int, images: Mapping[str, np.ndarray]) -> None:
        """``{name: (N, H, W, 3) floats in [0, 1]}`` at ``step``."""

    def log_hparams(self, hparams: Mapping[str, Any]) -> None:
        """The run's flattened config, ``{"optimizer.learning_rate": 1e-3, ...}`` (scalars and strings)."""

    def log_artifact(self, path: str) -> None:
        """A small file the run wrote (its summary); a tracker with a store may copy it there."""

    def log_reference(self, name: str, path: str) -> None:
        """A large thing (a checkpoint) named by its path, never copied."""

    def flush(self) -> None:
        """Push what is buffered."""

    def close(self, status: str = "finished") -> None:
        """End the run (``status``: "finished", "failed", "preempted" or "interrupted") and release files and
        threads."""


class TrackerBase:
    """Do-nothing defaults, so a backend implements only what it supports."""

    name = "tracker"

    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        pass

    def log_images(self, step: int, images: Mapping[str, np.ndarray]) -> None:
        pass

    def log_hparams(self, hparams: Mapping[str, Any]) -> None:
        pass

    def log_artifact(self, path: str) -> None:
        pass

    def log_reference(self, name: str, path: str) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self, status: str = "finished") -> None:
        pass


def describe(error: BaseException) -> str:
    """A short reason: the OS's words for an OSError, else the exception's type and message."""
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:200]}" if text else type(error).__name__


class Guard:
    """Runs tracker calls so that a failure costs one warning, and its end one more line.

    Logs are not worth a training run: a tracker whose disk filled up or whose server went away
    warns once, keeps being tried (cheap for files; network trackers work in their own thread) and
    says so when it writes again.
    """

    def __init__(self) -> None:
        self.failing: set[str] = set()

    def call(self, what: str, fn: Callable[[], Any]) -> bool:
        """Run ``fn``; returns whether it worked."""
        try:
            fn()
        except Exception as e:  # any tracker failure: the run goes on without it
            if what not in self.failing:
                logging.warning("%s: cannot write (%s); training goes on, and these logs resume once writing works",
                                what, describe(e))
            self.failing.add(what)
            return False
        if what in self.failing:
            logging.warning("%s: writing again", what)
            self.failing.discard(what)
        return True


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; values other than numbers, strings and bools become strings."""
    return dotted.flatten(tree, prefix, lambda v: v if isinstance(v, (bool, int, float, str)) or v is None else str(v))
