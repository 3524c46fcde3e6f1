"""Early stopping: end a run whose eval metric has stopped improving (``train.early_stop_*``).

Its state (best value, evaluations since the last improvement) travels in every checkpoint's
metadata, so a resumed run counts on where the checkpointed one was; a run that stopped saves
``early_stop.stopped`` with its last checkpoint, which is how a resume and a sweep know it ended.
"""

from __future__ import annotations

import logging
from typing import Any

import ml_collections as mlc

from jaxrat.checkpointing.store import EARLY_STOP_KEY as META_KEY
from jaxrat.config_schema import field
from jaxrat.runtime.errors import ConfigError
from jaxrat.tasks.base import Task


def evaluations(config: mlc.ConfigDict) -> int:
    """How many evaluations a run of ``config`` makes (every ``eval_every`` steps, and at the end)."""
    t, total = config.train, int(config.num_train_steps)
    every = max(1, int(t.eval_every))
    return total // every + (1 if field(t, "train.eval_at_end") and total % every else 0)


class EarlyStop:
    """Counts evaluations without an improvement of ``min_delta`` in ``metric``; off when patience is 0."""

    def __init__(self, config: mlc.ConfigDict, task: Task, warn: bool = True) -> None:
        t, c = config.train, config.checkpoint
        self.patience = int(field(t, "train.early_stop_patience") or 0)
        self.min_delta = float(field(t, "train.early_stop_min_delta") or 0.0)
        self.metric = str(field(t, "train.early_stop_metric") or c.best_metric)
        self.mode = c.best_mode if self.metric == c.best_metric else str(field(t, "train.early_stop_mode"))
        self.best: float | None = None
        self.best_step: int | None = None
        self.bad = 0
        self.stopped: str = ""  # why the run stopped, once it has
        if self.patience < 0 or self.min_delta < 0:
            raise ConfigError(f"config.train.early_stop_patience={self.patience} / early_stop_min_delta="
                              f"{self.min_delta}; use a patience >= 0 (0: off) and a min_delta >= 0.")
        if not self.patience:
            return
        names = [f"eval/{n}" for n in task.metric_names]
        if not self.metric:
            raise ConfigError("config.train.early_stop_patience is set but no metric is named; set "
                              "--config.checkpoint.best_metric (or --config.train.early_stop_metric), e.g. "
                              f"to {names[0]}.")
        if self.metric not in names:
            raise ConfigError(f"config.train.early_stop_metric={self.metric!r} is not computed by this task; "
                              f"use one of {names}.")
        if self.mode not in ("max", "min"):
            raise ConfigError(f"config.train.early_stop_mode={self.mode!r}; use 'max' or 'min'.")
        evals = evaluations(config)
        if warn and evals <= self.patience:  # the first evaluation sets the best; `patience` more can stop the run
            logging.warning("early stopping cannot trigger in this run: it evaluates %d times (num_train_steps=%d, "
                            "train.eval_every=%d) and needs %d evaluations to stop (1 + "
                            "train.early_stop_patience=%d); lower the patience or evaluate more often",
                            evals, config.num_train_steps, t.eval_every, self.patience + 1, self.patience)

    @property
    def on(self) -> bool:
        return self.patience > 0

    def update(self, step: int, metrics: dict[str, float] | None) -> bool:
        """Count the evaluation at ``step``; True when the run should stop here."""
        if not self.on or not metrics or self.metric not in metrics:
            return False
        value = float(metrics[self.metric])
        better = self.best is None or (value > self.best + self.min_delta if self.mode == "max"
                                       else value < self.best - self.min_delta)
        if better:
            self.best, self.best_step, self.bad = value, step, 0
            return False
        self.bad += 1
        if self.bad < self.patience:
            return False
        self.stopped = (f"{self.metric} has not improved by more than {self.min_delta:g} on its best "
                        f"{self.best:.6g} (step {self.best_step}) in {self.bad} evaluations "
                        f"(train.early_stop_patience={self.patience})")
        logging.info("early stopping at step %d: %s", step, self.stopped)
        return True

    def state(self) -> dict[str, Any]:
        """The checkpoint metadata entry (``{}`` when off)."""
        if not self.on:
            return {}
        return {META_KEY: {"metric": self.metric, "mode": self.mode, "best": self.best, "best_step": self.best_step,
                           "bad": self.bad, "patience": self.patience, "min_delta": self.min_delta,
                           "stopped": bool(self.stopped), "reason": self.stopped}}

    def load(self, meta: dict[str, Any]) -> None:
        """Continue from a checkpoint's metadata (a different metric or mode starts counting afresh)."""
        saved = meta.get(META_KEY) or {}
        if not self.on or saved.get("metric") != self.metric or saved.get("mode") != self.mode:
            return
        self.best, self.best_step, self.bad = saved.get("best"), saved.get("best_step"), int(saved.get("bad", 0))
        # A resume with more patience or a smaller delta continues a run that stopped early.
        same_rule = saved.get("patience") == self.patience and saved.get("min_delta") == self.min_delta
        self.stopped = saved.get("reason", "") if saved.get("stopped") and same_rule else ""

    def summary(self, step: int) -> dict[str, Any] | None:
        """For summary.json: where and why the run stopped (None if it did not)."""
        if not self.stopped:
            return None
        return {"step": step, "reason": self.stopped, "metric": self.metric, "best": self.best,
                "best_step": self.best_step}

