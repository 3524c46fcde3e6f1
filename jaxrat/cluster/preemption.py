"""Preemption: the signals that ask a run to stop, the agreed step where every process stops, and the exit status.

SLURM (``--signal=USR1@T``, ``scancel``, the time limit) and LSF warn a job with SIGUSR1 or
SIGTERM. Every process must stop at the *same* step so that they all take part in the last
checkpoint save: with several processes JAX's preemption sync point agrees on that step, with one
process a signal handler sets a flag. The run then exits with :data:`PREEMPTED_EXIT_CODE`, on which
the job scripts requeue.

Ctrl-C (SIGINT) is the same stop asked for by a person: the first one saves at the next step
boundary and the run exits with :data:`INTERRUPTED_EXIT_CODE` (130, as shells report an
interrupted command) and one line saying how to resume; a second one during training ends the
process at once (the default action, restored by the first: no traceback, even inside a compile).
During start-up, before the first step, a second one ends the run at once too, but with that line
and the workdir lock released (:mod:`jaxrat.cluster.startup_exit`). Only flags are set in the
handlers, so a Ctrl-C that arrives while a checkpoint is being written (in a thread, a callback, a
finaliser) is never raised there and lost: the loop honours it at its next check.

JAX is imported inside the functions: :mod:`jaxrat.launch` reads :data:`PREEMPTED_EXIT_CODE` from
here to render job scripts without loading JAX.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any

from jaxrat.cluster import startup_exit

# Exit status after a preemption checkpoint; the job scripts requeue the job on it.
PREEMPTED_EXIT_CODE = 42
# Exit status after Ctrl-C: 128 + SIGINT, what shells report for an interrupted command.
INTERRUPTED_EXIT_CODE = 130


class Preempted(Exception):
    """A preemption signal arrived; a checkpoint was written and the run should exit for requeue."""


class Interrupted(Preempted):
    """Ctrl-C: stopped as for a preemption (checkpoint saved), exit :data:`INTERRUPTED_EXIT_CODE`."""


_sigterm = threading.Event()
_sigint = threading.Event()
_handler_installed = False
_processes = 1  # set by note_process_count once the world is known; a signal handler must not ask JAX
_forwarded = False


def _on_sigterm(signum: int, frame: Any) -> None:
    if _sigterm.is_set():  # a second SIGTERM: the trainer is not listening, so die as usual
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
    _sigterm.set()


def _on_sigusr1(signum: int, frame: Any) -> None:
    # SLURM's `--signal=USR1@T` warning. JAX's preemption notifier only listens for SIGTERM, so with
    # several processes pass it on as one; a single process treats it like a first SIGTERM.
    if _processes > 1:
        os.kill(os.getpid(), signal.SIGTERM)
    else:
        _sigterm.set()


def _stop_for_ctrl_c() -> None:
    """The first Ctrl-C's stop: the flags and the notice, once (from SIGINT's handler, or from the
    start-up window's thread when it read the Ctrl-C)."""
    if _sigint.is_set():
        return
    _sigint.set()
    # os.write, not logging: a handler may run while the main thread holds the logging lock.
    os.write(2, b"\njaxrat: Ctrl-C: stopping at the next step to save a checkpoint (Ctrl-C again exits now)\n")
    if _processes > 1:  # every process must stop at the same step: JAX's notifier listens for SIGTERM
        os.kill(os.getpid(), signal.SIGTERM)
    else:
        _sigterm.set()


def _on_sigint(signum: int, frame: Any) -> None:
    if startup_exit.handled_here():  # start-up: its thread has read this Ctrl-C already, compile or not
        return
    _stop_for_ctrl_c()
    # A second Ctrl-C ends the process at once, as the default action does (status 130 in a shell):
    # no Python code runs for it, so no traceback, and it works inside a long compile or step too.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def interrupted() -> bool:
    """Whether the stop was asked for with Ctrl-C (SIGINT) in this process."""
    return _sigint.is_set()


def install_handlers(start_up_exit: bool = False) -> None:
    """Handle SIGTERM, SIGUSR1 and SIGINT from here on: call it on the first line of a command's ``main``.

    Installed lazily (at the first step's check) they left data preparation and the first compile
    (30-120 s) to the default actions: a SIGTERM ended the run with -15, which the job script does
    not requeue, and SLURM's ``--signal=USR1@T`` warning killed it outright. A signal that arrives
    now only sets the flag the loop checks before its first step and at every step. With
    ``start_up_exit`` (the train command) a second Ctrl-C before the first step ends the run at once,
    with its closing line and the workdir lock released (:mod:`jaxrat.cluster.startup_exit`).
    """
    global _handler_installed
    if _handler_installed or threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGTERM, _on_sigterm)
    signal.signal(signal.SIGUSR1, _on_sigusr1)
    signal.signal(signal.SIGINT, _on_sigint)
    if start_up_exit:
        startup_exit.open_window(_stop_for_ctrl_c, INTERRUPTED_EXIT_CODE)
    _handler_installed = True


def note_process_count(count: int) -> None:
    """The run's process count, once ``jax.distributed`` has started (and JAX's preemption notifier
    has taken SIGTERM over): a SIGTERM that came before is passed on to it, so every process agrees
    on where to stop."""
    global _processes, _forwarded
    _processes = count
    if count > 1 and _sigterm.is_set() and not _forwarded:
        _forwarded = True
        os.kill(os.getpid(), signal.SIGTERM)


def signalled() -> bool:
    """Whether SIGTERM or SIGUSR1 arrived in this process (one process: the stop flag itself)."""
    return _sigterm.is_set()


def preemption_requested(step: int) -> bool:
    """True at the call where every process should save a checkpoint and stop (SIGTERM or SIGUSR1).

    Call it with the same consecutive numbers in all processes (once per training step, and more
    often if the loop also checks inside the evaluation). With several processes it is JAX's
    preemption sync point (any process's signal, agreed call for all). A single process has no JAX
    preemption service; the first call installs a SIGTERM handler that sets a flag instead (a
    second SIGTERM still terminates), so the job scripts' TERM before the time limit checkpoints
    here too. SIGUSR1 is handled the same way in both cases.
    """
    global _handler_installed
    import jax

    if not _handler_installed and threading.current_thread() is threading.main_thread():
        note_process_count(jax.process_count())
        if jax.process_count() == 1:  # with several, SIGTERM belongs to JAX's notifier
            signal.signal(signal.SIGTERM, _on_sigterm)
        signal.signal(signal.SIGUSR1, _on_sigusr1)
        _handler_installed = True
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        return multihost_utils.reached_preemption_sync_point(step)
    return _sigterm.is_set()


class PreemptionWatch:
    """Asks, at every train step and every eval batch, whether all processes should stop here.

    With several processes this is JAX's preemption sync point, which agrees on the call after the
    furthest process's current one; it only works when every process calls it with the same
    consecutive numbers, so this class owns one counter for the whole run (the checkpoint manager
    must not call the sync point itself). With one process it reads the SIGTERM/SIGUSR1 flag.
    """

    def __init__(self) -> None:
        self._calls = 0

    def requested(self) -> bool:
        """True exactly at the call where every process stops (same call in all of them)."""
        self._calls += 1
        return preemption_requested(self._calls)

    def hold_signals(self) -> None:
        """From now on, log SIGTERM/SIGUSR1 instead of dying (call once the loop stops to save).

        A second signal would otherwise kill a single process mid-save (harmless to the files, but
        the work since the last checkpoint is lost) or during its exit (losing the requeue exit
        status). With several processes SIGTERM belongs to JAX's preemption notifier, where a
        repeat is a no-op, so only SIGUSR1 is taken over there.
        """
        import jax

        if threading.current_thread() is not threading.main_thread():
            return
        sigs = [signal.SIGUSR1] + ([signal.SIGTERM] if jax.process_count() == 1 else [])
        for s in sigs:
            signal.signal(s, _log_and_ignore)


def _log_and_ignore(signum: int, frame: Any) -> None:
    logging.warning("signal %d after the preemption notice: ignored, the checkpoint is being written", signum)
