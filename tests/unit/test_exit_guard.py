"""The writes a quick exit waits for (jaxrat/runtime/exit_guard.py): close() falls between them, never
in one, and a write nested in another does not wait for the exit its outer one holds up."""

from __future__ import annotations

import threading
import time

import pytest

from jaxrat.runtime import exit_guard


@pytest.fixture
def fresh_guard(monkeypatch):
    monkeypatch.setattr(exit_guard, "_cond", threading.Condition())
    monkeypatch.setattr(exit_guard, "_running", 0)
    monkeypatch.setattr(exit_guard, "_closing", False)


def _in_thread(fn) -> threading.Thread:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


def test_close_waits_for_a_write_under_way_and_keeps_new_ones_from_starting(fresh_guard):
    events, inside = [], threading.Event()

    def write(name: str, hold_s: float) -> None:
        with exit_guard.whole():
            inside.set()
            time.sleep(hold_s)
            events.append(name)

    first = _in_thread(lambda: write("first", 0.3))
    inside.wait(5)
    exit_guard.close()
    events.append("closed")
    late = _in_thread(lambda: write("late", 0))
    late.join(0.3)
    first.join(5)
    assert events == ["first", "closed"] and late.is_alive()


def test_a_write_nested_in_another_runs_while_close_waits(fresh_guard):
    events, outer_in, closing = [], threading.Event(), threading.Event()

    def write() -> None:
        with exit_guard.whole():
            outer_in.set()
            closing.wait(5)
            time.sleep(0.1)  # close() is waiting now
            with exit_guard.whole():  # the same thread: it must not wait for the exit it holds up
                events.append("inner")
        events.append("outer")

    writer = _in_thread(write)
    outer_in.wait(5)
    closer = _in_thread(lambda: (closing.set(), exit_guard.close(), events.append("closed")))
    closer.join(5)
    writer.join(5)
    assert events == ["inner", "outer", "closed"]
