"""Stop every process at the same point when the job is told to leave (SIGTERM, SIGUSR1)."""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

import jax

from jaxrat import distributed


class PreemptionWatch:
    """Asks, at every train step and every eval batch, whether all processes should stop here.

    With several processes this is JAX's preemption sync point, which agrees on the call after the
    furthest process's current one; it only works when every process calls it with the same
    consecutive numbers, so this class owns one counter for the whole run (Orbax's own calls are
    disabled in :class:`_Manager`). With one process it reads the SIGTERM/SIGUSR1 flag.
    """

    def __init__(self) -> None:
        self._calls = 0

    def requested(self) -> bool:
        """True exactly at the call where every process stops (same call in all of them)."""
        self._calls += 1
        return distributed.preemption_requested(self._calls)

    def hold_signals(self) -> None:
        """From now on, log SIGTERM/SIGUSR1 instead of dying (call once the loop stops to save).

        A second signal would otherwise kill a single process mid-save (harmless to the files, but
        the work since the last checkpoint is lost) or during its exit (losing the requeue exit
        status). With several processes SIGTERM belongs to JAX's preemption notifier, where a
        repeat is a no-op, so only SIGUSR1 is taken over there.
        """
        if threading.current_thread() is not threading.main_thread():
            return
        sigs = [signal.SIGUSR1] + ([signal.SIGTERM] if jax.process_count() == 1 else [])
        for s in sigs:
            signal.signal(s, _log_and_ignore)


def _log_and_ignore(signum: int, frame: Any) -> None:
    logging.warning("signal %d after the preemption notice: ignored, the checkpoint is being written", signum)
