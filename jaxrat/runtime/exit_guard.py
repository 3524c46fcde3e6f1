"""Writes that a quick exit waits for: taking the workdir lock, config.json, a checkpoint.

A second Ctrl-C during a run's start-up ends the process from a thread of its own with
``os._exit`` (:mod:`jaxrat.cluster.startup_exit`), which runs no cleanup. A write cut there would
leave a lock taken but never released, a config.json moved aside with none in its place, or a
checkpoint folder without its commit. Such a write runs inside :func:`whole`; :func:`close` waits
until none runs and keeps new ones from starting, so the exit falls between writes, never in one.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_cond = threading.Condition()
_running = 0  # whole() sections in progress, in every thread
_closing = False
_depth = threading.local()  # a thread's nesting: an inner section must not wait for the exit its outer one holds up


@contextlib.contextmanager
def whole() -> Iterator[None]:
    """Run the block to its end before any :func:`close` returns; once one has, never start it."""
    global _running
    outer = not getattr(_depth, "n", 0)
    if outer:
        with _cond:
            while _closing:  # the process is ending: this write would be cut, so it never starts
                _cond.wait()
            _running += 1
    _depth.n = getattr(_depth, "n", 0) + 1
    try:
        yield
    finally:
        _depth.n -= 1
        if outer:
            with _cond:
                _running -= 1
                _cond.notify_all()


def close() -> None:
    """Wait until no :func:`whole` block runs, and keep new ones from starting: the caller ends the
    process next. Call it from a thread that is not inside one."""
    global _closing
    with _cond:
        _closing = True
        while _running:
            _cond.wait()
