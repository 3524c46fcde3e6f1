"""A second Ctrl-C during a run's start-up: the run ends at once, with its closing line and its lock released.

The first Ctrl-C asks the run to stop at its next check (:mod:`jaxrat.cluster.preemption`). During
start-up that check can be minutes away (data preparation, the restore, XLA compiling the first
step), and before the first step there is nothing new to save, so a second Ctrl-C ends the run
there and then. Python runs a signal handler only between bytecodes of the main thread, which a
compile keeps inside XLA for minutes; so while the window is open SIGINT is read from the
interpreter's wakeup pipe (``signal.set_wakeup_fd``), written as the signal arrives, by a thread of
its own. At the second one that thread waits for the writes that must not be cut
(:mod:`jaxrat.runtime.exit_guard`: the lock's taking, config.json, a checkpoint), stops the input
workers and releases the workdir lock (what the run registered with :func:`on_exit`), prints the
line a first Ctrl-C ends start-up with, and ends the process with ``os._exit`` and the interrupted
status. A third Ctrl-C while it waits ends the process there and then, with the same line.

The window closes after the first step, or when the run returns or raises (:func:`done`); from
there a Ctrl-C is the signal handler's again, and a second one ends the process by the default
action (see :mod:`jaxrat.cluster.preemption`).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable

from jaxrat.runtime import exit_guard

_lock = threading.RLock()  # SIGINT's handler may take it in the main thread while that thread holds it
_open = False
_sigints = 0  # read while the window was open
_ending = threading.Event()
_pipe: tuple[int, int] = (-1, -1)  # the wakeup pipe: (read end, write end)
_previous_wakeup = -1
_on_first: Callable[[], None] = lambda: None
_status = 1
_releases: list[Callable[[], None]] = []
_step: int | None = None  # the step the run goes on from, once known


def closing_line(step: int | None) -> str:
    """The line a Ctrl-C during start-up ends the run with, the run going on from ``step`` (None: not
    known yet, the workdir not looked at)."""
    if step is None:
        return "interrupted during start-up; run the same command to resume"
    kept = f"the checkpoint of step {step} is kept" if step else "no checkpoint yet"
    return f"interrupted before step {step + 1} (during start-up, {kept}); run the same command to resume"


def open_window(on_first: Callable[[], None], status: int) -> None:
    """Read SIGINT from the wakeup pipe until :func:`done`: the first one calls ``on_first`` (the stop's
    flag and notice), the second ends the process with ``status``. Main thread, after SIGINT's handler
    is installed (the interpreter writes the pipe only for signals with a Python handler)."""
    global _open, _on_first, _status, _pipe, _previous_wakeup
    if _open or threading.current_thread() is not threading.main_thread():
        return
    r, w = os.pipe()
    os.set_blocking(w, False)  # the interpreter's signal handler must never block on it
    _previous_wakeup = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    _pipe, _on_first, _status, _open = (r, w), on_first, status, True
    threading.Thread(target=_read, args=(r,), name="jaxrat-startup-ctrl-c", daemon=True).start()


def handled_here() -> bool:
    """For SIGINT's handler (main thread): whether the window takes this Ctrl-C. It is open (or its
    exit under way) and its thread reads the pipe; or something replaced the wakeup pipe since, and
    the Ctrl-C is counted here."""
    if not (_open or _ending.is_set()):
        return False
    if threading.current_thread() is threading.main_thread():
        current = signal.set_wakeup_fd(_pipe[1], warn_on_full_buffer=False)
        if current != _pipe[1]:
            signal.set_wakeup_fd(current)  # another owner's: leave it theirs
            note_sigint()
    return True


def note_sigint() -> None:
    """One Ctrl-C while the window is open: the first stops at the next check; the second ends the run,
    on a thread of its own (this one may be the main thread inside a guarded write, or the pipe's
    reader, which must go on reading); a third, while that exit still waits, ends it without waiting."""
    global _sigints
    with _lock:
        if not (_open or _ending.is_set()):
            return
        _sigints += 1
        count = _sigints
    if count == 1:
        _on_first()
    elif count == 2:
        threading.Thread(target=_end, name="jaxrat-startup-exit", daemon=True).start()
    else:  # a write that never ends (a dead filesystem) must not make Ctrl-C useless
        _say_and_exit()


def on_exit(release: Callable[[], None]) -> Callable[[], None]:
    """Call ``release`` (e.g. the workdir lock's) before a second Ctrl-C ends the run; returns the
    function that forgets it again. ``release`` must be safe to call from another thread, and when
    there is nothing to release."""
    with _lock:
        _releases.append(release)

    def forget() -> None:
        with _lock:
            if release in _releases:
                _releases.remove(release)
    return forget


def note_step(step: int) -> None:
    """The step the run goes on from (the workdir's newest checkpoint, then the restored one)."""
    global _step
    _step = step


def done() -> None:
    """Close the window (main thread): the first step ran, or the run returns or raises. When a Ctrl-C
    came while it was open, the next one ends the process by the default action, as after a first
    Ctrl-C during training. Waits for ever if a second one is already ending the process."""
    global _open
    if threading.current_thread() is not threading.main_thread():
        return
    with _lock:
        was_open, came, _open = _open, _sigints > 0, False
    while _ending.is_set():  # the exit is under way on its thread (and takes the process with it)
        time.sleep(1)
    if not was_open:
        return
    current = signal.set_wakeup_fd(_previous_wakeup)
    if current != _pipe[1]:
        signal.set_wakeup_fd(current)  # another owner's since the window opened: leave it theirs
    os.close(_pipe[1])  # the reader sees the end of the pipe and returns
    if came:
        signal.signal(signal.SIGINT, signal.SIG_DFL)


def _read(fd: int) -> None:
    try:
        while True:
            data = os.read(fd, 64)
            if not data:
                return
            for _ in range(data.count(signal.SIGINT)):
                note_sigint()
    finally:
        os.close(fd)


def _end() -> None:
    """End the process between guarded writes, the lock released and the closing line printed."""
    with _lock:
        if not _open or _ending.is_set():
            return
        _ending.set()
        releases = list(_releases)
    exit_guard.close()
    for release in reversed(releases):
        try:
            release()
        except Exception:  # noqa: BLE001 - the exit goes on: a lock left behind is taken over with a warning
            pass
    _say_and_exit()


def _say_and_exit() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed or broken stream loses nothing that matters here
            pass
    os.write(2, f"\njaxrat: {closing_line(_step)}\n".encode())
    os._exit(_status)
