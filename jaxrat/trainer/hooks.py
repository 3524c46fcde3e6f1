"""Periodic actions of the train loop, each a small object owning its own state.

:class:`Chrono` measures throughput and input wait between log points; :class:`TrainLog` fetches
and writes the step metrics at log steps and stops a diverged run; :class:`Evaluation` runs the
task's eval at its steps; :class:`Saver` decides and makes the checkpoints; :class:`RunHooks`
holds them with early stopping and the moving average's evaluation, and calls them in order after
each step, so the loop (:mod:`jaxrat.trainer.loop`) names no feature.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable

import jax
import ml_collections as mlc
import numpy as np

from jaxrat.checkpointing import Checkpointer, Policy, SaveSchedule
from jaxrat.checkpointing.store import rank
from jaxrat.cluster import Interrupted, Preempted, PreemptionWatch, preemption, startup_exit
from jaxrat.runtime import console
from jaxrat.runtime.errors import ConfigError, UserError
from jaxrat.tasks.base import Task
from jaxrat.tracking.writers import MetricWriter, format_progress
from jaxrat.trainer.early_stop import EarlyStop

RAW_PREFIX = "eval_raw/"  # the raw parameters' metrics when eval/* are those of their moving average


class TrainingDiverged(UserError):
    """The loss became NaN or Inf."""


class Chrono:
    """Steps/s, examples/s and the share of time the devices waited for input, per log window.

    The loop dispatches steps ahead of the devices, so "waiting for the next batch" is free while
    the last dispatched step still runs; only the wait after the devices went idle counts.
    """

    def __init__(self, global_batch: int, start_step: int, t_created: float) -> None:
        self.global_batch, self.start_step, self.t_created = global_batch, start_step, t_created
        self.t_start = self.t_last = time.perf_counter()
        self.steps = 0
        self.data_wait = 0.0
        self._last_output: jax.Array | None = None
        self._first_step_s: float | None = None
        self.total_steps = 0  # dispatched in this run
        self._t_first_done: float | None = None

    def devices_busy(self) -> bool:
        """Whether the last dispatched step is still running."""
        return self._last_output is not None and not self._last_output.is_ready()

    def step_dispatched(self, output: jax.Array, waited_s: float) -> None:
        """Count a step whose (any) output is ``output``, after ``waited_s`` seconds of idle devices.

        The run's first step is waited for once, to report the time to first step (setup, restore
        and compilation: what the compilation cache saves on a resumed run) with the next window.
        """
        first = self._last_output is None
        self._last_output, self.steps, self.data_wait = output, self.steps + 1, self.data_wait + waited_s
        self.total_steps += 1
        if first:
            jax.block_until_ready(output)
            self._t_first_done = time.perf_counter()
            self._first_step_s = self._t_first_done - self.t_created
            logging.info("first step done %.1f s after the run started (setup, restore, compilation)",
                         self._first_step_s)

    def window(self) -> dict[str, float]:
        """The rates since the last call, and restart the window."""
        now = time.perf_counter()
        span = max(now - self.t_last, 1e-9)
        out = {"train/steps_per_sec": self.steps / span,
               "train/examples_per_sec": self.steps * self.global_batch / span,
               "train/data_wait_fraction": self.data_wait / span}
        if self._first_step_s is not None:
            out["train/time_to_first_step_s"], self._first_step_s = self._first_step_s, None
        self.t_last, self.steps, self.data_wait = now, 0, 0.0
        return out

    def elapsed(self) -> float:
        return time.perf_counter() - self.t_start

    def examples_per_sec(self) -> float | None:
        """Examples/s over this run after its first step (compilation left out); None before two steps.

        Call it when the last step is done (after the last log step's fetch)."""
        if self._t_first_done is None or self.total_steps < 2:
            return None
        span = max(time.perf_counter() - self._t_first_done, 1e-9)
        return (self.total_steps - 1) * self.global_batch / span


def device_memory() -> dict[str, float]:
    """GiB in use and at peak on this process's busiest device, where the backend reports it (GPUs
    and TPUs do; CPUs return nothing, and then so does this)."""
    stats = [s for d in jax.local_devices() if (s := _memory_stats(d))]
    out = {}
    for key, name in (("bytes_in_use", "train/device_memory_gb"), ("peak_bytes_in_use", "train/device_peak_memory_gb")):
        values = [s[key] for s in stats if key in s]
        if values:
            out[name] = max(values) / 2**30
    return out


def _memory_stats(device: jax.Device) -> dict[str, Any] | None:
    try:
        return device.memory_stats()
    except Exception:  # some backends raise instead of returning None
        return None


class TrainLog:
    """Keeps each step's metrics on the device until a log step, then fetches them all at once
    (one host sync per window), stops on a non-finite step and writes the window's means."""

    def __init__(self, writer: MetricWriter, chrono: Chrono, total_steps: int, every: int,
                 last_good: Callable[[], str]) -> None:
        self.writer, self.chrono, self.total, self.every = writer, chrono, total_steps, every
        self.last_good = last_good
        self.pending: list[tuple[int, dict[str, jax.Array]]] = []
        self.last: dict[str, float] = {}  # the last window's scalars, for the run summary
        self.last_step = 0
        self.examples_per_epoch = 0  # set once the data is known: the progress line counts epochs

    def add(self, step: int, metrics: dict[str, jax.Array]) -> bool:
        """Queue ``step``'s metrics; returns whether ``step`` is a log step (and logs it)."""
        self.pending.append((step, metrics))
        due = step % self.every == 0 or step == self.total
        if due:
            self.flush(step)
        return due

    def flush(self, step: int) -> None:
        """Fetch, check and write what is queued; raise :class:`TrainingDiverged` on a non-finite step."""
        if not self.pending:
            return
        fetched = jax.device_get([m for _, m in self.pending])
        bad = [s for (s, _), m in zip(self.pending, fetched) if m["train/nonfinite"] > 0]
        if bad:
            good = self.last_good()
            fix = "lower --config.optimizer.learning_rate or set --config.optimizer.clip_norm"
            if good:
                raise TrainingDiverged(f"Loss became NaN/Inf at step {bad[0]}; the run stopped without applying that "
                                       f"update and the last good checkpoint ({good}) is kept; {fix} and resume.")
            raise TrainingDiverged(f"Loss became NaN/Inf at step {bad[0]}, before any checkpoint was saved, so there "
                                   f"is nothing to resume; {fix} and train again.")
        scalars = {k: float(np.mean([m[k] for m in fetched])) for k in fetched[-1] if k != "train/nonfinite"}
        scalars["train/learning_rate"] = float(fetched[-1]["train/learning_rate"])
        scalars.update(self.chrono.window())
        scalars.update(device_memory())
        self.writer.write_scalars(step, scalars)
        self.last, self.last_step = scalars, step
        if jax.process_index() == 0:
            epoch = step * self.chrono.global_batch / self.examples_per_epoch if self.examples_per_epoch else None
            console.progress(format_progress(step, self.total, scalars, self.chrono.elapsed(),
                                             step - self.chrono.start_step, epoch, bar=console.on_terminal()))
        self.pending.clear()


class Evaluation:
    """Runs the task's evaluation every ``train.eval_every`` steps (and at the end), writes its
    metrics and images, and keeps the last metrics."""

    def __init__(self, config: mlc.ConfigDict, task: Task, eval_step: Callable, to_global: Callable,
                 writer: MetricWriter) -> None:
        self.config, self.task, self.eval_step, self.to_global, self.writer = config, task, eval_step, to_global, writer
        self.total = config.num_train_steps
        self.last: dict[str, float] = {}
        self.last_raw: dict[str, float] = {}  # eval_raw/* of the last eval, when EMA is on
        self.last_step: int | None = None
        # The best value of checkpoint.best_metric among this run's evals: {"metric", "value", "step"}.
        self.best: dict[str, Any] | None = None

    def due(self, step: int) -> bool:
        t = self.config.train
        return step % t.eval_every == 0 or (step == self.total and t.eval_at_end)

    def run(self, step: int, params: Any, interrupt: Callable[[], bool], raw_params: Any = None
            ) -> dict[str, float] | None:
        """``{"eval/<metric>": value}`` over the whole eval split, or None when ``interrupt()`` (asked
        before every batch, in every process alike) cut it short.

        With ``raw_params`` (the trained parameters when ``params`` is their moving average) those are
        evaluated too and logged as ``eval_raw/<metric>``; ``eval/*`` stays the ranked, reported one.
        """
        metrics, acc = self._evaluate(params, interrupt)
        if metrics is None:
            return None
        raw: dict[str, float] = {}
        if raw_params is not None:
            raw, _ = self._evaluate(raw_params, interrupt)
            if raw is None:
                return None
        self.last_accumulator = acc  # for per-image results (python -m jaxrat.evaluate)
        named = {f"eval/{k}": v for k, v in metrics.items()}
        named_raw = {f"{RAW_PREFIX}{k}": v for k, v in raw.items()}
        self.last, self.last_raw, self.last_step = metrics, named_raw, step
        self._rank(step, named)
        self.writer.write_scalars(step, {**named, **named_raw})
        images = acc.images() if self.config.train.log_images else {}
        if images:
            self.writer.write_images(step, images)
        if jax.process_index() == 0:
            known = self.task.metric_names
            order = [k for k in known if k in metrics] + sorted(set(metrics) - set(known))
            line = " ".join(f"{k} {metrics[k]:.4f}" for k in order)
            if raw:
                line = f"{line} (EMA; raw parameters: " + " ".join(f"{k} {raw[k]:.4f}" for k in order) + ")"
            logging.info("eval step %d: %s", step, line)
        return {**named, **named_raw}

    def _evaluate(self, params: Any, interrupt: Callable[[], bool]) -> tuple[dict[str, float] | None, Any]:
        acc = self.task.new_eval()
        for batch in self.task.eval_batches(global_batch=self.config.data.eval_batch_size,
                                            process_index=jax.process_index(), process_count=jax.process_count()):
            if interrupt():
                return None, acc
            sums, outputs = self.eval_step(params, self.to_global(batch))
            acc.update(sums, batch, outputs)
        return acc.finalize(), acc

    def _rank(self, step: int, named: dict[str, float]) -> None:
        c = self.config.checkpoint
        value = named.get(c.best_metric)
        if value is None:
            return
        best = self.best
        if best is None or rank(value, step, c.best_mode) > rank(best["value"], best["step"], c.best_mode):
            self.best = {"metric": c.best_metric, "mode": c.best_mode, "value": float(value), "step": step}


class Saver:
    """Checkpoints at the steps the policy asks for, and on preemption; logs how long the loop blocked."""

    def __init__(self, ckpt: Checkpointer, policy: Policy, total_steps: int, writer: MetricWriter,
                 watch: PreemptionWatch | None = None) -> None:
        self.ckpt, self.writer = ckpt, writer
        self.schedule = SaveSchedule(policy, total_steps)
        self.watch = watch or PreemptionWatch()
        self.extra: Callable[[], dict[str, Any]] = dict  # metadata saved with every checkpoint (early stopping)

    def save(self, step: int, state: Any, data_state: Any, reason: str, metrics: dict[str, float] | None = None,
             eval_pending: bool = False) -> None:
        """Start saving ``state`` and the data position at ``step``."""
        blocked = self.ckpt.save(step, state, data_state, reason=reason, metrics=metrics, eval_pending=eval_pending,
                                 extra=self.extra())
        self.schedule.saved()
        if blocked is not None:
            self.writer.write_scalars(step, {"checkpoint/blocked_s": blocked})

    def maybe_save(self, step: int, state: Any, data_state: Any, *, log_step: bool,
                   metrics: dict[str, float] | None) -> None:
        """Save when the schedule says so (every N steps or minutes, the last step)."""
        reason = self.schedule.reason(step, log_step=log_step)
        if reason:
            self.save(step, state, data_state, reason, metrics=metrics)

    def preemption_requested(self) -> bool:
        """Whether every process stops here (the same answer, at the same call, in all of them)."""
        return self.watch.requested()

    def stop_for_preemption(self, step: int, state: Any, data_state: Any, eval_pending: bool) -> None:
        """Save, wait until the save is durable, and raise :class:`Preempted` for the requeue exit."""
        self.watch.hold_signals()  # a second signal must not cut this save short or change the exit status
        self.save(step, state, data_state, "preemption", eval_pending=eval_pending)
        self.ckpt.wait()
        where = "during evaluation " if eval_pending else ""
        if preemption.interrupted():
            raise Interrupted(f"interrupted {where}at step {step}; run the same command to resume")
        raise Preempted(f"preempted {where}at step {step}: checkpoint saved, exit for requeue")

    def last_good(self) -> str:
        """The newest durable checkpoint, e.g. "step 200 in /w/checkpoints" (waits for saves in
        flight); "" when there is none."""
        self.ckpt.wait()
        step = self.ckpt.latest_step()
        return "" if step is None else f"step {step} in {self.ckpt.directory}"

    def finish(self) -> None:
        """Wait for the last saves and log the loop's blocking time per save."""
        self.ckpt.wait()
        b = self.ckpt.blocked_s
        if b:
            logging.info("checkpoints: %d saves; train loop blocked %.3f s on average, %.3f s at most",
                         len(b), float(np.mean(b)), max(b))


@dataclasses.dataclass
class RunHooks:
    """Every periodic action of one run, in the order the loop calls them after each step: the
    step log, the evaluation (of the parameters' moving average when the run keeps one, with the
    raw parameters' as ``eval_raw/*``), the preemption checks, early stopping and the checkpoints.
    The loop (:mod:`jaxrat.trainer.loop`) names none of them."""

    chrono: Chrono
    log: TrainLog
    evaluation: Evaluation
    saver: Saver
    early: EarlyStop
    params_of: Callable[[Any], Any]  # the parameters evaluation scores
    raw_of: Callable[[Any], Any]  # the raw parameters beside them, or None
    images_per_sec: float | None = None

    @classmethod
    def create(cls, config: mlc.ConfigDict, task: Task, spec: Any, ckpt: Checkpointer, policy: Policy,
               writer: MetricWriter, watch: PreemptionWatch, eval_step: Callable, to_global: Callable,
               start: Any, t_created: float) -> RunHooks:
        """The hooks of a run that starts at ``start`` (:func:`jaxrat.trainer.state.restore_or_init`)."""
        total = config.num_train_steps
        chrono = Chrono(config.data.batch_size, start.step, t_created)
        saver = Saver(ckpt, policy, total, writer, watch)
        early = EarlyStop(config, task)
        early.load(start.meta)
        saver.extra = early.state  # every checkpoint carries the count: a resume goes on from it
        log = TrainLog(writer, chrono, total, config.train.log_every, saver.last_good)
        log.examples_per_epoch = task.num_train_examples()
        return cls(chrono, log, Evaluation(config, task, eval_step, to_global, writer), saver, early,
                   spec.eval_params, lambda state: state["params"] if spec.ema else None)

    def evaluate(self, step: int, state: Any) -> dict[str, float] | None:
        return self.evaluation.run(step, self.params_of(state), self.saver.preemption_requested,
                                   raw_params=self.raw_of(state))

    def resume(self, step: int, state: Any, data: Callable[[], Any], eval_pending: bool) -> bool:
        """Before the first step: stop if a preemption came during start-up; redo the evaluation a
        preemption cut short (``eval_pending``); True when the run has ended already (early
        stopping said so in its last checkpoint)."""
        stop_if_preempted(self.saver.watch, step)
        if eval_pending:
            evaluated = self.evaluate(step, state)
            if evaluated is None:
                self.saver.stop_for_preemption(step, state, data(), eval_pending=True)
            if self.early.update(step, evaluated):
                self.saver.save(step, state, data(), "early_stop", metrics=evaluated)
        if self.early.stopped:
            logging.info("stopped early at step %d (%s); nothing to do", step, self.early.stopped)
        return bool(self.early.stopped)

    def after_step(self, step: int, state: Any, metrics: dict[str, jax.Array], waited_s: float,
                   data: Callable[[], Any]) -> bool:
        """Log, evaluate, check for preemption, stop early, save, after ``step``; True: the run ends."""
        self.chrono.step_dispatched(metrics["train/loss"], waited_s)
        log_step = self.log.add(step, metrics)
        eval_due = self.evaluation.due(step)
        if self.saver.preemption_requested():
            self.log.flush(step)
            self.saver.stop_for_preemption(step, state, data(), eval_pending=eval_due)
        evaluated = self.evaluate(step, state) if eval_due else None
        if eval_due and evaluated is None:
            self.log.flush(step)
            self.saver.stop_for_preemption(step, state, data(), eval_pending=True)
        if self.early.update(step, evaluated):  # the last checkpoint says so: resumes and sweeps see it
            self.log.flush(step)
            self.saver.save(step, state, data(), "early_stop", metrics=evaluated)
            return True
        self.saver.maybe_save(step, state, data(), log_step=log_step, metrics=evaluated)
        return False

    def finish(self) -> None:
        """The run's throughput (before the last saves' wait), then wait for those saves."""
        self.images_per_sec = self.chrono.examples_per_sec()
        self.saver.finish()

    def summary(self, step: int) -> dict[str, Any]:
        """What the hooks add to the run summary (:func:`jaxrat.trainer.run_summary.build`)."""
        ips = self.images_per_sec if self.images_per_sec is not None else self.chrono.examples_per_sec()
        return {"last_train": self.log.last, "images_per_sec": ips, "last_eval": self.evaluation.last,
                "best": self.evaluation.best, "last_eval_raw": self.evaluation.last_raw,
                "stopped_early": self.early.summary(step)}


def stop_if_preempted(watch: PreemptionWatch, step: int) -> None:
    """Raise :class:`Preempted` when a stop signal came before training reached ``step``'s next
    step (during data preparation, restore or start-up): there is nothing new to save."""
    if not watch.requested():
        return
    watch.hold_signals()
    if preemption.interrupted():
        raise Interrupted(startup_exit.closing_line(step))
    kept = f"the checkpoint of step {step} is kept" if step else "no checkpoint yet"
    raise Preempted(f"preempted before step {step + 1} (during start-up): nothing to save, {kept}; exit for requeue")


def check_config(config: mlc.ConfigDict, policy: Policy, task: Task) -> None:
    """The hooks' settings, checked before the data is prepared: each mistake in one sentence."""
    check_best_metric(policy, task)
    EarlyStop(config, task, warn=False)


def check_best_metric(policy: Policy, task: Task) -> None:
    """``checkpoint.best_metric`` must name one of the task's eval metrics; say so before training."""
    names = [f"eval/{n}" for n in task.metric_names]
    if policy.best_metric and policy.best_metric not in names:
        raise ConfigError(f"config.checkpoint.best_metric={policy.best_metric!r} is not computed by this task; "
                          f"use one of {names}.")
