"""Orbax checkpoints of {train state, data iterator}: async, atomic, multi-host, resharding restore.

Every process calls every method (saves are collective). Orbax writes ``<step>.orbax-checkpoint-tmp``
and renames it when complete, so a killed save never yields a checkpoint that restore would pick;
leftover temporary folders are removed when the manager starts.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp


class Checkpointer:
    """Saves and restores the train state and the Grain iterator under ``directory``."""

    def __init__(self, directory: str, *, keep: int = 3, async_save: bool = True):
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=True,
            create=True,
        )
        self._mngr = ocp.CheckpointManager(self.directory, item_names=("state", "data"), options=options)
        self.last_blocking_s = 0.0

    def latest_step(self) -> int | None:
        """Newest complete checkpoint step, or None."""
        return self._mngr.latest_step()

    def all_steps(self) -> list[int]:
        """Every complete checkpoint step, ascending."""
        return sorted(self._mngr.all_steps())

    def save(self, step: int, state: Any, data_iter: grain.DatasetIterator | None = None, *, force: bool = False) -> bool:
        """Start saving ``state`` (and the iterator position) at ``step``; returns whether it saved."""
        items = {"state": ocp.args.StandardSave(state)}
        if data_iter is not None:
            items["data"] = grain.checkpoint.CheckpointSave(data_iter)
        t0 = time.perf_counter()
        saved = self._mngr.save(step, args=ocp.args.Composite(**items), force=force)
        self.last_blocking_s = time.perf_counter() - t0
        if saved:
            logging.info("checkpoint: saving step %d (train loop blocked %.3f s)", step, self.last_blocking_s)
        return saved

    def _data_saved_for_this_topology(self, step: int) -> bool:
        name = f"process_{jax.process_index()}-of-{jax.process_count()}.json"
        return os.path.exists(os.path.join(self.directory, str(step), "data", name))

    def restore(self, step: int, abstract_state: Any, data_iter: grain.DatasetIterator | None = None) -> tuple[Any, bool]:
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

    def wait(self) -> None:
        """Block until pending async saves are durable."""
        self._mngr.wait_until_finished()

    def close(self) -> None:
        """Finish pending saves and release resources."""
        self._mngr.wait_until_finished()
        self._mngr.close()
