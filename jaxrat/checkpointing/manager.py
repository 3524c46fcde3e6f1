"""Orbax checkpoints of {train state, data iterator}: save, best pointer, restore the newest.

Every process calls every method (saves are collective). A save is invisible until it commits:
Orbax writes ``<step>.orbax-checkpoint-tmp-*`` and renames it, or, with
``checkpoint.atomic_rename=False`` for filesystems without an atomic rename, writes ``<step>/`` in
place and adds ``commit_success.txt`` last. Either way a killed save is never restored and its
leftovers are deleted when the next run starts. Checkpoints hold arrays (OCDBT/Zarr) and JSON only;
nothing is unpickled or executed on restore.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp

from jaxrat.checkpointing import store
from jaxrat.checkpointing.schedule import Policy, metric_fn, preservation


class _Manager(ocp.CheckpointManager):
    """Orbax's manager, minus its own calls into JAX's preemption sync point."""

    def reached_preemption(self, step: int) -> bool:
        # The train loop owns JAX's sync point and feeds it one consecutive counter (train steps
        # and eval batches); Orbax calling it with step numbers would move that counter and could
        # make every process miss the agreed point.
        return False


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
            preservation_policy=preservation(p),
            best_fn=metric_fn(p) if p.tracks_best else None,  # also makes Orbax store the metrics
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
                value = (store.step_metadata(self.directory, step).get("metrics") or {}).get(p.best_metric)
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
        path = os.path.join(self.directory, store.BEST_FILE)
        with open(path + ".tmp", "w") as f:
            json.dump(pointer, f)
        os.replace(path + ".tmp", path)  # readers re-rank from metadata if this is not atomic

    def step_metadata(self, step: int) -> dict[str, Any]:
        """What :meth:`save` stored with ``step`` (reason, metrics, eval_pending, topology)."""
        return store.step_metadata(self.directory, step)

    def _data_saved_for_this_topology(self, step: int) -> bool:
        name = f"process_{jax.process_index()}-of-{jax.process_count()}.json"
        return os.path.exists(os.path.join(self.directory, str(step), "data", name))

    def restore(self, step: int, abstract_state: Any, data_iter: Any = None) -> tuple[Any, bool]:
        """Restore ``step`` onto the shardings carried by ``abstract_state`` (any mesh, any process count).

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
        """(step, state, data_restored) of the newest checkpoint, or None when there is none.

        See :meth:`restore` for the shardings and when the data iterator is restored.
        """
        step = self.latest_step()
        if step is None:
            return None
        state, data_ok = self.restore(step, abstract_state, data_iter)
        return step, state, data_ok

    def wait(self) -> None:
        """Block until pending async saves are durable, then update the best pointer."""
        self._mngr.wait_until_finished()
        self._inflight = None
        self._write_best_pointer()

    def close(self) -> None:
        """Finish pending saves and release resources."""
        self.wait()
        self._mngr.close()
