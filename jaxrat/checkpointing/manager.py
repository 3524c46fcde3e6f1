"""Orbax checkpoints of {train state, data iterator}: save, best pointer, restore the newest.

Every process calls every method (saves are collective). A save is invisible until it commits:
Orbax writes ``<step>.orbax-checkpoint-tmp-*`` and renames it, or, with
``checkpoint.atomic_rename=False`` for filesystems without an atomic rename, writes ``<step>/`` in
place and adds ``commit_success.txt`` last. Either way a killed save is never restored and its
leftovers are deleted when the next run starts. Checkpoints hold arrays (OCDBT/Zarr) and JSON only;
nothing is unpickled or executed on restore.

Faults: a checkpoint that cannot be read back (truncated or corrupt files, or arrays whose digest
differs from the one stored at save) is moved to ``damaged/`` and the next older one restored; a
save that fails because the disk is full raises :class:`~jaxrat.runtime.errors.CheckpointError` after
removing the failed step's folder, leaving the previous checkpoints as they were.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import time
import warnings
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp
from etils import epath

from jaxrat.checkpointing import digest, recovery, store
from jaxrat.checkpointing.named_arrays import named_leaves
from jaxrat.checkpointing.schedule import Policy, metric_fn, preservation
from jaxrat.checkpointing.snapshot import FrozenDataState, Snapshotter, use_distributed_barriers
from jaxrat.runtime import exit_guard
from jaxrat.runtime.errors import CheckpointError, ConfigError
from jaxrat.runtime.fileio import write_json


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
        if p.async_save:
            use_distributed_barriers()
        options = ocp.CheckpointManagerOptions(
            # Async saves run Orbax's synchronous save on our own thread (see snapshot.py): Orbax's
            # async path does its per-array work on the caller's thread.
            enable_async_checkpointing=False,
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
        self._state_reader = ocp.StandardCheckpointHandler()
        self._inflight: int | None = None
        self._pending: concurrent.futures.Future | None = None
        self._worker = (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="checkpoint-save")
                        if p.async_save else None)
        self._snapshot = Snapshotter()
        self._metric: dict[int, float] = {}
        if p.tracks_best:
            for step in self._mngr.all_steps():
                value = (store.step_metadata(self.directory, step).get("metrics") or {}).get(p.best_metric)
                if value is not None:
                    self._metric[step] = float(value)
        self.blocked_s: list[float] = []  # train-loop stall of each save, seconds
        self._failed: int | None = None  # the step whose save failed; nothing is pending after it

    def latest_step(self) -> int | None:
        """Newest complete checkpoint step, or None (waits for a save in flight)."""
        self._finish_inflight()
        return self._mngr.latest_step()

    def all_steps(self) -> list[int]:
        """Every kept checkpoint step, ascending (waits for a save in flight)."""
        self._finish_inflight()
        return sorted(self._mngr.all_steps())

    def save(self, step: int, state: Any, data_iter: Any = None, *, reason: str,
             metrics: dict[str, float] | None = None, eval_pending: bool = False,
             extra: dict[str, Any] | None = None) -> float | None:
        """Start saving ``state`` and the data position at ``step``; returns the seconds the caller was
        blocked, or None when ``step`` is already saved.

        ``metrics`` (eval metrics of this step, e.g. ``{"eval/dice": 0.8}``) rank the checkpoint for
        ``best_metric``; ``eval_pending`` tells a resumed run to run this step's eval first;
        ``extra`` (JSON) is stored beside them for the loop's own bookkeeping (early stopping).
        """
        t0 = time.perf_counter()
        # One save at a time: usually the previous one ended long ago and this costs nothing; this
        # also names the step if that save failed.
        self._finish_inflight()
        if step in self._mngr.all_steps():
            return None
        clean = {k: float(v) for k, v in (metrics or {}).items()}
        meta = {"reason": reason, "eval_pending": eval_pending, "metrics": clean,
                "process_count": jax.process_count(), "device_count": jax.device_count(), **(extra or {})}
        if self.policy.tracks_best:
            meta.update(best_metric=self.policy.best_metric, best_mode=self.policy.best_mode)
            if self.policy.best_metric in clean:
                self._metric[step] = clean[self.policy.best_metric]
        if self._worker is None:
            self._write(step, state, data_iter, meta, clean, lambda: digest.digest(state))
            blocked = time.perf_counter() - t0
        else:
            # What the loop waits for: a copy no later step can change, and the data position now.
            copy, digests = self._snapshot(state)
            data = FrozenDataState(data_iter) if data_iter is not None else None
            self._inflight = step
            self._pending = self._worker.submit(self._write, step, copy, data, meta, clean, digests)
            blocked = time.perf_counter() - t0
        self.blocked_s.append(blocked)
        logging.info("checkpoint: saving step %d (%s), train loop blocked %.3f s", step, reason, blocked)
        return blocked

    def _write(self, step: int, state: Any, data_iter: Any, meta: dict[str, Any], metrics: dict[str, float],
               digests: Any) -> None:
        """Orbax's save and commit of one step (on the save thread for async saves), then the best pointer."""
        items = {"state": ocp.args.StandardSave(state)}
        if data_iter is not None:
            items["data"] = grain.checkpoint.CheckpointSave(data_iter)
        meta = {**meta, "digest": digests()}
        with exit_guard.whole():  # a second Ctrl-C during start-up ends the run after the commit, not in it
            try:
                self._mngr.save(step, args=ocp.args.Composite(**items), force=True, custom_metadata=meta,
                                metrics=metrics if self.policy.tracks_best else None)
            except Exception as e:
                if self._worker is None:
                    self._save_failed(step, e)
                raise
            self._inflight = None
            self._write_best_pointer()

    def _write_best_pointer(self) -> None:
        """Point ``best.json`` at the best *committed* checkpoint (process 0 writes it)."""
        if not self.policy.tracks_best or jax.process_index() != 0:
            return
        kept = set(self._mngr.all_steps()) - {self._inflight}
        ranked = [s for s in self._metric if s in kept]
        if not ranked:
            return
        step = max(ranked, key=lambda s: store.rank(self._metric[s], s, self.policy.best_mode))
        pointer = {"step": step, "metric": self.policy.best_metric, "mode": self.policy.best_mode,
                   "value": self._metric[step]}
        path = os.path.join(self.directory, store.BEST_FILE)
        write_json(path, pointer)  # readers re-rank from metadata if it is missing

    def step_metadata(self, step: int) -> dict[str, Any]:
        """What :meth:`save` stored with ``step`` (reason, metrics, eval_pending, topology)."""
        return store.step_metadata(self.directory, step)

    def _data_saved_for_this_topology(self, step: int) -> bool:
        name = f"process_{jax.process_index()}-of-{jax.process_count()}.json"
        return os.path.exists(os.path.join(self.directory, str(step), "data", name))

    def restore(self, step: int, abstract_state: Any, data_iter: Any = None) -> tuple[Any, bool]:
        """Restore ``step`` onto the shardings carried by ``abstract_state`` (any mesh, any process count).

        Returns (state, data_restored). The iterator is restored only when it was saved by the same
        number of processes; otherwise the caller recomputes the data position from the step. A state
        of other names or shapes than the checkpoint's raises ConfigError.

        The items are read with Orbax's handlers, not its manager, because the manager ends a restore
        with a barrier: a process that failed to read would skip it and leave the others waiting
        there, out of step with every later barrier and collective.
        """
        self._check_fits(step, abstract_state)
        where = epath.Path(self.directory) / str(step)
        state = self._state_reader.restore(where / "state", args=ocp.args.StandardRestore(abstract_state))
        data_ok = data_iter is not None and self._data_saved_for_this_topology(step)
        if data_ok:
            grain.checkpoint.CheckpointHandler().restore(where / "data",
                                                         args=grain.checkpoint.CheckpointRestore(data_iter))
        return state, data_ok

    def restore_latest(self, abstract_state: Any, data_iter: Any = None) -> tuple[int, Any, bool] | None:
        """(step, state, data_restored) of the newest readable checkpoint, or None when there is none.

        A checkpoint that cannot be read (any process fails to read it, or its arrays' digest differs
        from the one saved with it) is moved to ``damaged/`` with a warning, and the next older one
        is tried. A checkpoint of another model (names or shapes differ) raises ConfigError and is
        left in place. See :meth:`restore` for the shardings and the data iterator.
        """
        while (step := self.latest_step()) is not None:
            problem = None
            try:  # no collective in here: processes that fail and processes that do not stay in step
                state, data_ok = self.restore(step, abstract_state, data_iter)
            except ConfigError:
                raise
            except Exception as e:
                if recovery.is_out_of_memory(e):
                    raise
                logging.debug("checkpoint: reading step %d failed", step, exc_info=True)
                problem = recovery.short_reason(e)
            if recovery.all_agree(problem is None):
                # Every process holds the same global arrays and reads the same metadata: same verdict.
                expected = self.step_metadata(step).get("digest")
                bad = digest.mismatches(expected, state) if expected else []
                if not expected:  # saved before digests, or its metadata file removed: nothing to check against
                    logging.warning("checkpoint: step %d has no digests of its arrays (%s missing or without them), "
                                    "so it is restored unchecked", step, os.path.join(self.directory, str(step),
                                                                                      store.METADATA_FILE))
                if not bad:
                    self._check_step(step, state)
                    return step, state, data_ok
                problem = f"{bad[0]} reads back different from what was saved ({len(bad)} arrays differ)"
            self._set_aside(step, problem or "another process could not read it")
        return None

    def _check_step(self, step: int, state: Any) -> None:
        """A ConfigError when the folder ``<step>/`` holds another step's state (renamed by hand).

        Resuming it would train on from the state's own step while the folder stays the newest,
        so every later resume would go back to it and lose the steps trained since.
        """
        saved = state.get("step") if isinstance(state, dict) else None
        if saved is None or int(jax.device_get(saved)) == step:
            return
        saved = int(jax.device_get(saved))
        raise ConfigError(f"The checkpoint folder {self.directory}/{step} holds the state of step {saved} (it was "
                          f"renamed or copied by hand): rename it back to {self.directory}/{saved} (or move it out "
                          f"of {self.directory}), then run the same command to resume.")

    def _check_fits(self, step: int, abstract_state: Any) -> None:
        """A ConfigError when this run's state differs from the checkpoint's in names or shapes.

        Orbax's error for that would look like damage; metadata that cannot be read is damage.
        """
        saved = named_leaves(ocp.PyTreeCheckpointHandler().metadata(epath.Path(self.directory) / str(step) / "state")
                             .tree)
        want = named_leaves(abstract_state)
        hint = (f"resume with the config this workdir was started with ({os.path.dirname(self.directory)}/config.json)"
                f", or give this run a new workdir")
        saved_ema, want_ema = (any(n.startswith("ema_params/") for n in names) for names in (saved, want))
        if want_ema and not saved_ema:
            raise ConfigError(f"The checkpoint of step {step} in {self.directory} was saved without "
                              f"optimizer.ema_decay, so it holds no moving average to resume: resume with "
                              f"--config.optimizer.ema_decay=0, or start a new run in another --workdir with "
                              f"--config.init_from={os.path.dirname(self.directory)} (its weights start the average).")
        if saved_ema and not want_ema:
            raise ConfigError(f"The checkpoint of step {step} in {self.directory} holds a moving average of the "
                              f"parameters (optimizer.ema_decay was on) and this run has none: resume with the "
                              f"ema_decay of {os.path.dirname(self.directory)}/config.json, or give this run a new "
                              f"workdir (--config.init_from={os.path.dirname(self.directory)} loads its weights).")
        for name, leaf in want.items():
            have = saved.get(name)
            shape = tuple(getattr(have, "shape", ()) or ())
            if have is None or shape != tuple(leaf.shape):
                held = "lacks it" if have is None else f"holds it with shape {shape}"
                raise ConfigError(f"This run's {name} has shape {tuple(leaf.shape)} but the checkpoint of step {step} "
                                  f"in {self.directory} {held}; {hint}.")
        extra = sorted(set(saved) - set(want))
        if extra:
            raise ConfigError(f"The checkpoint of step {step} in {self.directory} holds {extra[0]}, which this run's "
                              f"state lacks; {hint}.")

    def _set_aside(self, step: int, problem: str) -> None:
        where = os.path.join(self.directory, str(step))
        moved = recovery.move_aside(self.directory, step)
        self._metric.pop(step, None)
        self._mngr.reload()
        logging.warning("checkpoint %s cannot be read (%s), so it was moved to %s and the run resumes from the "
                        "newest readable checkpoint, if any.", where, problem, moved)

    def wait(self) -> None:
        """Block until pending async saves are durable, then update the best pointer.

        Raises CheckpointError when the pending save failed because the disk is full.
        """
        self._finish_inflight()
        self._write_best_pointer()

    def close(self) -> None:
        """Finish pending saves and release resources (after a failed save: only release)."""
        if self._failed is None:
            self.wait()
        if self._worker is not None:
            self._worker.shutdown(wait=True)
        try:
            self._mngr.close()
            self._state_reader.close()
        except Exception:
            if self._failed is None:
                raise
            logging.debug("checkpoint: closing after the failed save of step %d", self._failed, exc_info=True)

    def _finish_inflight(self) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.result()
        except Exception as e:
            step, self._inflight = self._inflight, None
            self._save_failed(step, e)
        self._inflight = None

    def _save_failed(self, step: int | None, error: Exception) -> None:
        """Clean up after a failed save and raise: one sentence when the disk is full."""
        self._failed = -1 if step is None else step
        if step is not None:
            self._metric.pop(step, None)
            try:  # let the save's other writer threads end before removing what they wrote
                self._mngr.wait_until_finished()
            except Exception:
                logging.debug("checkpoint: waiting for the failed save of step %d", step, exc_info=True)
            recovery.remove_uncommitted(self.directory, step)
        if not recovery.is_disk_full(error):
            raise error
        # Orbax's failed write leaves a coroutine it never awaited; Python would report it at exit,
        # after (and instead of being) the last line, which must be the sentence below.
        warnings.filterwarnings("ignore", message=r"coroutine '.*write_fragment' was never awaited",
                                category=RuntimeWarning)
        kept = store.committed_steps(self.directory)
        what = "the last save" if step is None else f"step {step}"
        previous = f"the last complete checkpoint (step {kept[-1]}) is intact" if kept else "no checkpoint was complete"
        raise CheckpointError(
            f"The disk holding {self.directory} is full, so the checkpoint of {what} could not be written and "
            f"was removed; {previous}: free space or lower config.checkpoint.keep, then run the same command to "
            f"resume."
        ) from error
