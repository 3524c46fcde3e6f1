"""SIGTERM and SIGINT as an exception, for commands that must end cleanly when stopped (predict).

A command writes its files whole or not at all (:mod:`jaxrat.runtime.fileio`) and cleans up on an
exception; SIGTERM's default action kills the process where it stands instead, leaving temporaries
and a silent exit 143. After :func:`raise_on_signals` both signals raise :class:`Stopped` in the
main thread, so the same cleanup runs and the command can say in one line why it ended.
"""

from __future__ import annotations

import signal
import threading

_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Stopped(KeyboardInterrupt):
    """The process was asked to stop by ``signum``; exit with ``128 + signum`` after cleaning up."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def _raise(signum: int, frame: object) -> None:
    raise Stopped(signum)


def raise_on_signals() -> None:
    """From now on, SIGTERM and SIGINT raise :class:`Stopped` in the main thread (a no-op elsewhere)."""
    if threading.current_thread() is threading.main_thread():
        for s in _SIGNALS:
            signal.signal(s, _raise)
