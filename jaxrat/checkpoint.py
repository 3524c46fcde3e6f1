"""Orbax checkpoints of {train state, data iterator}: save policy, preemption, best pointer, restore.

Every process calls every method (saves are collective). A save is invisible until it commits:
Orbax writes ``<step>.orbax-checkpoint-tmp-*`` and renames it, or, with
``checkpoint.atomic_rename=False`` for filesystems without an atomic rename, writes ``<step>/`` in
place and adds ``commit_success.txt`` last. Either way a killed save is never restored and its
leftovers are deleted when the next run starts. Checkpoints hold arrays (OCDBT/Zarr) and JSON only;
nothing is unpickled or executed on restore.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from typing import Any

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import checkpoint_managers as ocm

from jaxrat import checkpoints as reader
from jaxrat.errors import ConfigError
from jaxrat.tree_paths import named_leaves


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
        return bool(self.best_metric) and self.keep_best > 0


class _Manager(ocp.CheckpointManager):
    """Orbax's manager, minus its own calls into JAX's preemption sync point."""

    def reached_preemption(self, step: int) -> bool:
        # The train loop owns JAX's sync point and feeds it one consecutive counter (train steps
        # and eval batches); Orbax calling it with step numbers would move that counter and could
        # make every process miss the agreed point.
        return False


def _preservation(p: Policy) -> ocm.AnyPreservationPolicy:
    policies: list[Any] = [ocm.LatestN(n=p.keep)]
    if p.keep_every:
        policies.append(ocm.EveryNSteps(interval_steps=p.keep_every))
    if p.tracks_best:
        policies.append(ocm.BestN(get_metric_fn=_metric_fn(p), reverse=p.best_mode == "min", n=p.keep_best,
                                  keep_checkpoints_without_metrics=False))
    return ocm.AnyPreservationPolicy(policies)


def _metric_fn(p: Policy):
    worst = -math.inf if p.best_mode == "max" else math.inf
    # Checkpoints saved without an eval (time or preemption saves) rank last, never best.
    return lambda metrics: float(metrics.get(p.best_metric, worst))


class Checkpointer:
    """Saves and restores the train state and the data iterator under ``directory``."""

    def __init__(self, directory: str, policy: Policy | None = None):
        self.directory = os.path.abspath(directory)
        self.policy = policy or Policy()
        p = self.policy
        modes = ocp.options.AtomicityMode
        options = ocp.CheckpointManagerOptions(
            enable_async_checkpointing=p.async_save,
            cleanup_tmp_directories=True,  # a killed save's folder goes away at the next start
            create=True,
            preservation_policy=_preservation(p),
            best_fn=_metric_fn(p) if p.tracks_best else None,  # also makes Orbax store the metrics
            best_mode=p.best_mode,
            atomicity_options=ocp.options.AtomicityOptions(
                mode=modes.ATOMIC_RENAME if p.atomic_rename else modes.COMMIT_FILE
            ),
        )
        self._mngr = _Manager(self.directory, item_names=("state", "data"), options=options)
        self._inflight: int | None = None
        self._metric: dict[int, float] = {}
        if p.tracks_best:
            for step in self._mngr.all_steps():
                value = (reader.step_metadata(self.directory, step).get("metrics") or {}).get(p.best_metric)
                if value is not None:
                    self._metric[step] = float(value)
        self.blocked_s: list[float] = []  # train-loop stall of each save, seconds

    def latest_step(self) -> int | None:
        """Newest complete checkpoint step, or None."""
        return self._mngr.latest_step()

    def all_steps(self) -> list[int]:
        """Every kept checkpoint step (the one being written included), ascending."""
        return sorted(self._mngr.all_steps())

    def save(self, step: int, state: Any, data_iter: Any = None, *, reason: str,
             metrics: dict[str, float] | None = None, eval_pending: bool = False) -> float | None:
        """Start saving ``state`` and the data position at ``step``; returns the seconds the caller was
        blocked, or None when ``step`` is already saved.

        ``metrics`` (eval metrics of this step, e.g. ``{"eval/dice": 0.8}``) rank the checkpoint for
        ``best_metric``; ``eval_pending`` tells a resumed run to run this step's eval first.
        """
        if step in self._mngr.all_steps():
            return None
        items = {"state": ocp.args.StandardSave(state)}
        if data_iter is not None:
            items["data"] = grain.checkpoint.CheckpointSave(data_iter)
        clean = {k: float(v) for k, v in (metrics or {}).items()}
        meta = {"reason": reason, "eval_pending": eval_pending, "metrics": clean,
                "process_count": jax.process_count(), "device_count": jax.device_count()}
        if self.policy.tracks_best:
            meta.update(best_metric=self.policy.best_metric, best_mode=self.policy.best_mode)
            if self.policy.best_metric in clean:
                self._metric[step] = clean[self.policy.best_metric]
        t0 = time.perf_counter()
        self._mngr.save(step, args=ocp.args.Composite(**items), force=True, custom_metadata=meta,
                        metrics=clean if self.policy.tracks_best else None)
        blocked = time.perf_counter() - t0
        self.blocked_s.append(blocked)
        # Orbax waited for the previous save before starting this one, so that one is committed.
        self._inflight = step if self.policy.async_save else None
        self._write_best_pointer()
        logging.info("checkpoint: saving step %d (%s), train loop blocked %.3f s", step, reason, blocked)
        return blocked

    def _write_best_pointer(self) -> None:
        """Point ``best.json`` at the best *committed* checkpoint (process 0 writes it)."""
        if not self.policy.tracks_best or jax.process_index() != 0:
            return
        kept = set(self._mngr.all_steps()) - {self._inflight}
        ranked = [(v if self.policy.best_mode == "max" else -v, s) for s, v in self._metric.items() if s in kept]
        if not ranked:
            return
        step = max(ranked)[1]
        pointer = {"step": step, "metric": self.policy.best_metric, "mode": self.policy.best_mode,
                   "value": self._metric[step]}
        path = os.path.join(self.directory, reader.BEST_FILE)
        with open(path + ".tmp", "w") as f:
            json.dump(pointer, f)
        os.replace(path + ".tmp", path)  # readers re-rank from metadata if this is not atomic

    def step_metadata(self, step: int) -> dict[str, Any]:
        """What :meth:`save` stored with ``step`` (reason, metrics, eval_pending, topology)."""
        return reader.step_metadata(self.directory, step)

    def _data_saved_for_this_topology(self, step: int) -> bool:
        name = f"process_{jax.process_index()}-of-{jax.process_count()}.json"
        return os.path.exists(os.path.join(self.directory, str(step), "data", name))

    def restore(self, step: int, abstract_state: Any, data_iter: Any = None) -> tuple[Any, bool]:
        """Restore onto the shardings carried by ``abstract_state`` (any mesh, any process count).

        Returns (state, data_restored). The iterator is restored only when it was saved by the same
        number of processes; otherwise the caller recomputes the data position from the step.
        """
        items = {"state": ocp.args.StandardRestore(abstract_state)}
        data_ok = data_iter is not None and self._data_saved_for_this_topology(step)
        if data_ok:
            items["data"] = grain.checkpoint.CheckpointRestore(data_iter)
        restored = self._mngr.restore(step, args=ocp.args.Composite(**items))
        return restored["state"], data_ok

    def restore_latest(self, abstract_state: Any, data_iter: Any = None) -> tuple[int, Any, bool] | None:
        """(step, state, data_restored) of the newest checkpoint, or None."""
        step = self.latest_step()
        if step is None:
            return None
        return (step, *self.restore(step, abstract_state, data_iter))

    def wait(self) -> None:
        """Block until pending async saves are durable, then update the best pointer."""
        self._mngr.wait_until_finished()
        self._inflight = None
        self._write_best_pointer()

    def close(self) -> None:
        """Finish pending saves and release resources."""
        self.wait()
        self._mngr.close()


# ------------------------------------------------------------------------------ when to save

class SaveSchedule:
    """Decides at which steps the loop saves: every N steps, every M minutes, and the last step.

    The time rule is checked at log steps only, where the host already waits for the device, and
    process 0's clock decides for everyone (clocks of different hosts never agree exactly).
    """

    def __init__(self, policy: Policy, total_steps: int, clock=time.monotonic):
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


# ------------------------------------------------------------------------------- init_from

def load_init(spec: str, abstract_state: Any, *, optimizer: bool = False) -> dict[str, Any]:
    """Weights of another run for a new one: ``{"params": ...}`` (and ``"opt_state"`` when asked).

    ``spec`` is ``PATH[:STEP|:best|:latest]``; arrays land on the shardings of ``abstract_state``.
    A parameter whose shape differs, or that one side lacks, ends with a ConfigError naming it.
    """
    directory, step = reader.resolve(spec)
    keys = ["params"] + (["opt_state"] if optimizer else [])
    target = {k: abstract_state[k] for k in keys}
    where = os.path.join(directory, str(step))
    # The "state" item alone, read with the plain PyTree handler: no manager, nothing to clean up.
    with ocp.PyTreeCheckpointer() as ckptr:
        saved = ocp.PyTreeCheckpointHandler().metadata(epath.Path(where) / "state").tree
        _check_compatible(target, {k: saved[k] for k in keys if k in saved}, where, optimizer)
        restored = ckptr.restore(os.path.join(where, "state"), args=ocp.args.PyTreeRestore(
            item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True))
    logging.info("init_from: loaded %s from %s", " and ".join(keys), where)
    return dict(restored)


def _check_compatible(target: Any, saved: Any, where: str, optimizer: bool) -> None:
    want, have = named_leaves(target), named_leaves(saved)
    where = f"{os.path.dirname(where)} step {os.path.basename(where)}"
    hint = ("; train from scratch, or pick a checkpoint of the same model"
            + (" (or drop --config.checkpoint.init_optimizer)" if optimizer else ""))
    for path, leaf in want.items():
        if path not in have:
            raise ConfigError(f"init_from: {path} of this model is missing from the checkpoint {where}{hint}.")
        shape = tuple(getattr(have[path], "shape", ()))
        if shape != tuple(leaf.shape):
            raise ConfigError(
                f"init_from: {path} has shape {shape} in the checkpoint {where} but {tuple(leaf.shape)} in "
                f"this model{hint}."
            )
    extra = sorted(set(have) - set(want))
    if extra:
        raise ConfigError(f"init_from: the checkpoint {where} has {extra[0]}, which this model lacks{hint}.")
