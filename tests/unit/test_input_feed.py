"""DeviceFeed: batches ahead in a thread, checkpoint state of what was consumed, errors passed on."""

from __future__ import annotations

import json
import threading
import time

import pytest

from jaxrat.trainer.input_feed import DeviceFeed


class Counting:
    """A source like StreamIterator: its state is the next index; optionally fails at ``fail_at``."""

    def __init__(self, fail_at: int | None = None, stop_at: int | None = None) -> None:
        self.next, self.fail_at, self.stop_at, self.closed = 0, fail_at, stop_at, False
        self.produced = threading.Event()

    def __iter__(self):
        return self

    def __next__(self) -> int:
        if self.next == self.fail_at:
            raise ValueError(f"bad file at element {self.next}")
        if self.next == self.stop_at:
            raise StopIteration
        value, self.next = self.next, self.next + 1
        self.produced.set()
        return value

    def get_state(self) -> bytes:
        return json.dumps({"next": self.next}).encode()

    def close(self) -> None:
        self.closed = True


def _wait_for(cond, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        time.sleep(0.01)


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_batches_in_order_and_state_counts_only_consumed(depth):
    src = Counting()
    feed = DeviceFeed(src, lambda b: b * 10, depth=depth)
    assert json.loads(feed.consumed_state().get_state()) == {"next": 0}
    got = [next(feed) for _ in range(5)]
    assert got == [0, 10, 20, 30, 40]
    if depth:
        _wait_for(lambda: src.next >= 5 + depth + 1)
        time.sleep(0.2)
        assert src.next == 5 + depth + 1  # ``depth`` queued and one waiting for a free slot
    assert json.loads(feed.consumed_state().get_state()) == {"next": 5}
    feed.close()
    assert src.closed


def test_frozen_state_does_not_move_with_later_batches():
    feed = DeviceFeed(Counting(), lambda b: b, depth=2)
    next(feed)
    frozen = feed.consumed_state()
    next(feed), next(feed)
    assert json.loads(frozen.get_state()) == {"next": 1}
    with pytest.raises(TypeError):
        frozen.set_state(b"{}")
    feed.close()


@pytest.mark.parametrize("depth", [0, 2])
def test_error_in_source_reaches_the_consumer_unchanged(depth):
    feed = DeviceFeed(Counting(fail_at=3), lambda b: b, depth=depth)
    assert [next(feed) for _ in range(3)] == [0, 1, 2]
    for _ in range(2):  # and again on the next call, not a hang
        with pytest.raises(ValueError, match="bad file at element 3"):
            next(feed)
    assert json.loads(feed.consumed_state().get_state()) == {"next": 3}
    feed.close()


def test_end_of_a_finite_source_ends_iteration():
    feed = DeviceFeed(Counting(stop_at=4), lambda b: b, depth=2)
    assert list(feed) == [0, 1, 2, 3]
    feed.close()


def test_close_stops_a_thread_blocked_on_a_full_queue():
    src = Counting()
    feed = DeviceFeed(src, lambda b: b, depth=1)
    _wait_for(lambda: src.next >= 2)  # one queued, one waiting to be queued
    feed.close()
    assert not feed._thread.is_alive()
    produced = src.next
    time.sleep(0.3)
    assert src.next == produced


def test_negative_depth_is_refused():
    with pytest.raises(ValueError, match="depth"):
        DeviceFeed(Counting(), lambda b: b, depth=-1)


def test_device_put_in_the_thread_gives_sharded_global_arrays():
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxrat.parallel.mesh import make_mesh
    from jaxrat.trainer.loop import to_global

    mesh = make_mesh((("data", -1),))
    spec = NamedSharding(mesh, P("data"))

    class Batches(Counting):
        def __next__(self):
            i = super().__next__()
            return {"x": np.full((8, 2), i, np.float32)}

    feed = DeviceFeed(Batches(), lambda b: to_global(b, spec), depth=2)
    for i in range(3):
        batch = next(feed)
        assert isinstance(batch["x"], jax.Array) and batch["x"].sharding == spec
        np.testing.assert_array_equal(np.asarray(batch["x"]), np.full((8, 2), i, np.float32))
    feed.close()


class Slow(Counting):
    """A source whose every element takes ``delay`` seconds."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay

    def __next__(self) -> int:
        time.sleep(self.delay)
        return super().__next__()


@pytest.mark.parametrize("depth", [0, 2])
def test_waiting_while_the_devices_are_busy_is_not_data_wait(depth):
    feed = DeviceFeed(Slow(0.05), lambda b: b, depth=depth)
    try:
        got = [feed.next_timed(lambda: True) for _ in range(3)]
    finally:
        feed.close()
    assert got == [(0, 0.0), (1, 0.0), (2, 0.0)]


@pytest.mark.parametrize("depth", [0, 2])
def test_idle_devices_count_the_whole_wait(depth):
    feed = DeviceFeed(Slow(0.1), lambda b: b, depth=depth)
    try:
        batch, waited = feed.next_timed(lambda: False)
    finally:
        feed.close()
    assert batch == 0 and waited >= 0.09  # the source sleeps 0.1 s before the first batch


def test_only_the_time_after_the_devices_ran_dry_counts():
    polls = []

    def busy() -> bool:  # busy for the first 5 polls (about 5 * IDLE_POLL_S), then idle
        polls.append(time.perf_counter())
        return len(polls) <= 5

    feed = DeviceFeed(Slow(0.2), lambda b: b, depth=1)
    try:
        t0 = time.perf_counter()
        batch, waited = feed.next_timed(busy)
        total = time.perf_counter() - t0
    finally:
        feed.close()
    assert batch == 0 and len(polls) == 6  # polled until idle, then simply waited
    assert 0 < waited <= total - (polls[5] - t0) + 1e-3


def test_a_ready_batch_costs_nothing_even_on_idle_devices():
    src = Counting()
    feed = DeviceFeed(src, lambda b: b, depth=2)
    try:
        _wait_for(lambda: src.next >= 3)
        assert feed.next_timed(lambda: False) == (0, 0.0)
    finally:
        feed.close()
