"""When to save and which checkpoints to keep: ``config.checkpoint`` as a validated policy."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from orbax.checkpoint import checkpoint_managers as ocm

from jaxrat.runtime.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Policy:
    """When to save and what to keep (``config.checkpoint``)."""

    every_steps: int = 200
    every_minutes: float = 0.0
    keep: int = 3
    keep_every: int = 0
    best_metric: str = ""
    best_mode: str = "max"
    keep_best: int = 1
    async_save: bool = True
    atomic_rename: bool = True

    @classmethod
    def from_config(cls, c: Any) -> Policy:
        """Validate ``config.checkpoint``; a bad value ends with one sentence naming the field."""
        p = cls(**{f.name: c[f.name] for f in dataclasses.fields(cls)})
        for name, value in (("every_steps", p.every_steps), ("keep_every", p.keep_every), ("keep_best", p.keep_best),
                            ("every_minutes", p.every_minutes)):
            if value < 0:
                raise ConfigError(
                    f"config.checkpoint.{name}={value} is negative; use 0 to turn it off or a positive value."
                )
        if p.keep < 1:
            raise ConfigError(f"config.checkpoint.keep={p.keep}; keep at least 1 (a resumed run restores the latest).")
        if p.best_mode not in ("max", "min"):
            raise ConfigError(
                f"config.checkpoint.best_mode={p.best_mode!r}; use 'max' (e.g. eval/dice) or 'min' (eval/loss)."
            )
        if p.best_metric and not p.best_metric.startswith("eval/"):
            raise ConfigError(
                f"config.checkpoint.best_metric={p.best_metric!r} is not an eval metric; use a name like 'eval/dice'."
            )
        return p

    @property
    def tracks_best(self) -> bool:
        """Whether checkpoints are ranked by an eval metric."""
        return bool(self.best_metric) and self.keep_best > 0


def metric_fn(policy: Policy) -> Callable[[dict[str, float]], float]:
    """The ranking key Orbax applies to a step's stored metrics."""
    worst = -math.inf if policy.best_mode == "max" else math.inf
    # Checkpoints saved without an eval (time or preemption saves) rank last, never best.
    return lambda metrics: float(metrics.get(policy.best_metric, worst))


def preservation(policy: Policy) -> ocm.AnyPreservationPolicy:
    """Keep a step if any rule wants it: the latest K, every P-th, the best B."""
    policies: list[Any] = [ocm.LatestN(n=policy.keep)]
    if policy.keep_every:
        policies.append(ocm.EveryNSteps(interval_steps=policy.keep_every))
    if policy.tracks_best:
        policies.append(ocm.BestN(get_metric_fn=metric_fn(policy), reverse=policy.best_mode == "min",
                                  n=policy.keep_best, keep_checkpoints_without_metrics=False))
    return ocm.AnyPreservationPolicy(policies)


class SaveSchedule:
    """Decides at which steps the loop saves: every N steps, every M minutes, and the last step.

    The time rule is checked at log steps only, where the host already waits for the device, and
    process 0's clock decides for everyone (clocks of different hosts never agree exactly).
    """

    def __init__(self, policy: Policy, total_steps: int, clock: Callable[[], float] = time.monotonic):
        self.policy, self.total, self._clock = policy, total_steps, clock
        self._last = clock()

    def reason(self, step: int, *, log_step: bool) -> str | None:
        """Why ``step`` should be saved ("steps", "time", "final"), or None."""
        p = self.policy
        if step == self.total:
            return "final"
        if p.every_steps and step % p.every_steps == 0:
            return "steps"
        if p.every_minutes and log_step and self._time_due():
            return "time"
        return None

    def saved(self) -> None:
        """Restart the time rule's clock (after any save, whatever its reason)."""
        self._last = self._clock()

    def _time_due(self) -> bool:
        due = self._clock() - self._last >= 60.0 * self.policy.every_minutes
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            due = bool(multihost_utils.broadcast_one_to_all(np.int32(due)))
        return due
