"""Move host batches onto the devices ahead of the train step, in a background thread.

Without this the loop calls ``next(data_iterator)`` and ``device_put`` between two dispatches, so
batching, the host-to-device copy and any decoding the readers have not finished all count
against the step. Here a thread keeps ``depth`` global batches ready on the devices; the loop only
blocks when the pipeline is truly behind.

The loop dispatches steps asynchronously, so it may block on the next batch while the devices are
still busy with steps it queued earlier: that wait costs nothing. :meth:`DeviceFeed.next_timed`
counts only the time the devices sat idle for lack of a batch, which is what
``train/data_wait_fraction`` reports.

The checkpointed data position must be that of the batches the loop *consumed*, not of those
prefetched: each queued batch carries the iterator state read right after it was produced.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, Iterator

_DONE = object()
# How often a waiting consumer checks whether the devices have run out of queued work: the
# resolution of the data-wait measurement.
IDLE_POLL_S = 0.002


class FrozenState:
    """An iterator state fixed at one moment, in the shape Grain's checkpoint handler saves."""

    def __init__(self, state: bytes) -> None:
        self._state = state

    def get_state(self) -> bytes:
        return self._state

    def set_state(self, state: bytes) -> None:
        raise TypeError("a frozen iterator state cannot be restored into")

    def start_prefetch(self) -> None:
        pass


class Restorable:
    """Grain's checkpoint handler's view of any iterator with ``get_state``/``set_state``: Grain
    also calls ``start_prefetch`` after a restore, which a task's own iterator need not have."""

    def __init__(self, iterator: Any) -> None:
        self.iterator = iterator

    def get_state(self) -> Any:
        return self.iterator.get_state()

    def set_state(self, state: Any) -> None:
        self.iterator.set_state(state)

    def start_prefetch(self) -> None:
        start = getattr(self.iterator, "start_prefetch", None)
        if start:
            start()


class DeviceFeed:
    """Iterator over ``put(batch)`` for each batch of ``source``, produced ``depth`` batches ahead
    (plus the one the thread holds while the queue is full).

    ``source`` must have ``get_state() -> bytes`` (a :class:`jaxrat.data.pipeline.StreamIterator`);
    :meth:`consumed_state` is the state after the last batch handed out. An exception raised while
    producing a batch is raised again, unchanged, by the ``next()`` that would have returned it.
    ``depth=0`` produces each batch on demand in the caller's thread.
    """

    def __init__(self, source: Iterator[Any], put: Callable[[Any], Any], depth: int = 2) -> None:
        if depth < 0:
            raise ValueError(f"depth must be >= 0, got {depth}")
        self._source, self._put, self._depth = source, put, depth
        self._state = source.get_state()
        self._stop = threading.Event()
        self._queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
        self._thread: threading.Thread | None = None
        if depth:
            self._thread = threading.Thread(target=self._produce, name="jaxrat-device-feed", daemon=True)
            self._thread.start()

    def _produce(self) -> None:
        try:
            while not self._stop.is_set():
                self._offer((self._put(next(self._source)), self._source.get_state()))
        except BaseException as e:  # noqa: BLE001 - re-raised in the consumer's thread
            self._offer((_DONE, e))

    def _offer(self, item: Any) -> None:
        # Wait for a free slot, but give up when close() asks: nobody will take the item then.
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def __iter__(self) -> DeviceFeed:
        return self

    def __next__(self) -> Any:
        if self._thread is None:
            batch = self._put(next(self._source))
            self._state = self._source.get_state()
            return batch
        return self._take(self._queue.get())

    def next_timed(self, devices_busy: Callable[[], bool]) -> tuple[Any, float]:
        """The next batch, and the seconds the devices sat idle waiting for it.

        ``devices_busy()`` says whether the devices still have queued work (e.g. the last step's
        output is not ready). Waiting while they are busy is free and not counted; from the moment
        they are idle, it is. With ``depth=0`` the batch is made in this thread, so the devices
        cannot be watched meanwhile: the whole production time counts unless they are still busy
        when it ends (an upper bound).
        """
        t0 = time.perf_counter()
        if self._thread is None:
            batch = next(self)
            return batch, 0.0 if devices_busy() else time.perf_counter() - t0
        try:
            return self._take(self._queue.get_nowait()), 0.0
        except queue.Empty:
            pass
        idle_since = None
        while True:
            if idle_since is None and not devices_busy():
                idle_since = time.perf_counter()
            try:
                item = self._queue.get(timeout=IDLE_POLL_S if idle_since is None else None)
                break
            except queue.Empty:
                continue
        waited = time.perf_counter() - idle_since if idle_since is not None else 0.0
        return self._take(item), waited

    def _take(self, item: tuple[Any, Any]) -> Any:
        batch, state = item
        if batch is _DONE:
            self._queue.put((_DONE, state))  # every later next() raises the same way
            raise state
        self._state = state
        return batch

    def consumed_state(self) -> FrozenState:
        """The data position after the batches returned so far, for a checkpoint."""
        return FrozenState(self._state)

    def close(self) -> None:
        """Stop the thread (it finishes the batch it is producing) and close the source."""
        self._stop.set()
        if self._thread is not None:
            deadline = time.monotonic() + 30.0  # a reader stuck on a dead filesystem must not hang exit
            while self._thread.is_alive() and time.monotonic() < deadline:
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    pass
                self._thread.join(timeout=0.1)
        close = getattr(self._source, "close", None)
        if close:
            close()
