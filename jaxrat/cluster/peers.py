"""Lost peers: when one process of a run dies, the others stop within a bounded time and say which.

A process killed with -9 (OOM killer, a lost node, a user) leaves the others failing in, or
hanging inside, a collective or a checkpoint barrier; JAX's coordination service notices only
after its own heartbeat timeout and then aborts them with a C++ stack trace. Here every process
runs a :class:`PeerWatchdog`: it publishes a beat in the coordination service's key-value store
and reads everyone else's. A process whose beats stop for ``timeout`` seconds is lost; the
survivors print one sentence naming it and exit with :data:`PREEMPTED_EXIT_CODE`, on which the job
scripts requeue, because the run resumes exactly from its last checkpoint. :func:`initialize`
gives JAX's heartbeat a longer timeout so that this explanation comes first.

Beats come from threads, so a process that is merely busy (compiling, saving, evaluating) keeps
beating; only a dead or wholly stuck process goes silent.
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from jaxrat.cluster.preemption import PREEMPTED_EXIT_CODE

_KEY = "jaxrat/peers"
_DONE = "done"
_active: PeerWatchdog | None = None


class PeerWatchdog:
    """Beats for this process and declares a peer lost when its beats stop for ``timeout`` s.

    ``client`` is JAX's distributed runtime client (``key_value_set``/``key_value_dir_get``);
    ``on_lost`` receives the sentence and must end the process (the unit tests pass ``print``).
    """

    def __init__(self, client: Any, process_id: int, num_processes: int, timeout: float,
                 on_lost: Callable[[str], None] | None = None, clock: Callable[[], float] = time.monotonic):
        self.process_id, self.num_processes, self.timeout = process_id, num_processes, float(timeout)
        self.interval = min(max(self.timeout / 10, 0.2), 2.0)
        self._client, self._clock = client, clock
        self._on_lost = on_lost or _exit_for_requeue
        self._peers = [p for p in range(num_processes) if p != process_id]
        now = clock()
        self._seen = {p: now for p in self._peers}  # when each peer's beat last changed
        self._beat: dict[int, str] = {}
        self._changes = {p: 0 for p in self._peers}  # how many new beats of each peer were read
        self._who: dict[int, str] = {}
        self._contact = now  # last successful exchange with the coordination service
        self._count = 0
        self._finishing = False
        self._stopped = False
        self._lock = threading.Lock()
        self._calling = threading.Lock()  # held while a thread is inside the client (C++)

    def start(self) -> None:
        """Publish who this process is, then beat and judge in two daemon threads."""
        who = f"host {socket.gethostname()}, pid {os.getpid()}"
        self._client.key_value_set(f"{_KEY}/who/{self.process_id}", who, allow_overwrite=True)
        # Two threads: an exchange can block for long when the coordinator's host is gone, and
        # the judge must still notice the silence.
        for target, name in ((self._beat_loop, "beat"), (self._judge_loop, "judge")):
            threading.Thread(target=target, name=f"jaxrat-peer-{name}", daemon=True).start()

    def finish(self) -> None:
        """Tell the peers this process is ending on purpose, so its silence from now on is no loss."""
        self._finishing = True
        self.exchange()

    def exchange(self) -> None:
        """One beat: publish ours, read everyone's (the beat thread calls this every ``interval``)."""
        self._count += 1
        mine = _DONE if self._finishing else str(self._count)
        with self._calling:
            if self._stopped:
                return
            try:
                self._client.key_value_set(f"{_KEY}/beat/{self.process_id}", mine, allow_overwrite=True)
                entries = self._client.key_value_dir_get(f"{_KEY}/")
            except Exception:  # the coordinator is unreachable: the judge decides when that is too long
                return
        now = self._clock()
        with self._lock:
            self._contact = now
            for key, value in entries:
                kind, p = key.rstrip("/").split("/")[-2:]
                if kind == "who":
                    self._who[int(p)] = value
                elif int(p) != self.process_id and self._beat.get(int(p)) != value:
                    self._beat[int(p)], self._seen[int(p)] = value, now
                    self._changes[int(p)] = self._changes.get(int(p), 0) + 1

    def stop(self, wait_s: float = 10.0) -> None:
        """Stop calling the client and judging; returns once no call is in flight (at most ``wait_s``)."""
        idle = self._calling.acquire(timeout=wait_s)
        self._stopped = True
        if idle:
            self._calling.release()

    def lost(self) -> str | None:
        """The sentence naming a lost process, or None while every peer beats or has finished."""
        now = self._clock()
        with self._lock:
            if self._stopped:
                return None
            if now - self._contact > self.timeout:
                # Without the store (process 0 hosts it) no beat can be read: only process 0 can be judged.
                silent = [0] if self.process_id != 0 and self._beat.get(0) != _DONE else []
            else:
                silent = [p for p in self._peers if self._beat.get(p) != _DONE and now - self._seen[p] > self.timeout]
            if not silent:
                return None
            who = self._who.get(silent[0], "host unknown")
        return (f"process {silent[0]} of {self.num_processes} ({who}) has not been heard from for "
                f"{self.timeout:g} s, so it died or hangs; process {self.process_id} stops with exit status "
                f"{PREEMPTED_EXIT_CODE} for the job to be requeued and resume from the last checkpoint (raise "
                "config.distributed.heartbeat_timeout if a process may be silent that long).")

    def settled(self, since: dict[int, int]) -> bool:
        """True once every peer has been read with two new beats (or finished) since :meth:`beats`.

        Two: the store keeps only each peer's latest beat, so a peer that died can show one new
        beat after an error (published just before it died, read after a collective failed at
        once on its reset connection) but never a second; the judge then names it.
        """
        with self._lock:
            return all(self._beat.get(p) == _DONE or self._changes.get(p, 0) - since.get(p, 0) >= 2
                       for p in self._peers)

    def beats(self) -> dict[int, int]:
        """How many new beats of each peer were read so far: the snapshot :meth:`settled` compares to."""
        with self._lock:
            return dict(self._changes)

    def _beat_loop(self) -> None:
        while not self._stopped:
            self.exchange()
            time.sleep(self.interval)

    def _judge_loop(self) -> None:
        while not self._stopped:
            time.sleep(self.interval)
            sentence = self.lost()
            if sentence is not None:
                self._on_lost(sentence)
                return


def _exit_for_requeue(sentence: str) -> None:
    # os._exit: the main thread may be stuck in a collective, and JAX's exit handlers would wait
    # at the shutdown barrier for the process that is gone.
    sys.stderr.write(f"jaxrat: error: {sentence}\n")
    sys.stderr.flush()
    os._exit(PREEMPTED_EXIT_CODE)


def start_watchdog(client: Any, process_id: int, num_processes: int, timeout: float) -> PeerWatchdog:
    """Start this process's watchdog (``initialize`` does, for every multi-process run)."""
    global _active
    watchdog = PeerWatchdog(client, process_id, num_processes, timeout)
    watchdog.start()
    atexit.register(_at_exit, watchdog)
    _active = watchdog
    return watchdog


def _at_exit(watchdog: PeerWatchdog) -> None:
    """Say this process is finishing, leave JAX's distributed system while still judging (a survivor
    whose error came from a lost peer ends with the sentence rather than wait at JAX's shutdown
    barrier), then stop the watchdog. JAX's own exit handler would shut the client down later, when
    the beat thread may be inside a call to it; a daemon thread still inside C++ when the interpreter
    finalises is killed by a forced unwind, and the process aborts (status 134) after a clean run."""
    import jax

    watchdog.finish()
    jax.distributed.shutdown()
    watchdog.stop()


def stop_if_peer_lost() -> None:
    """After an error in a multi-process run: if a peer is lost, end with the sentence naming it.

    Returns once every peer has beaten twice again (the error was not a lost peer), at most after the
    watchdog's timeout; returns at once in a single-process run. Call it before re-raising, so a
    collective that failed because a peer died reports that instead of its own traceback.
    """
    watchdog = _active
    if watchdog is None:
        return
    since = watchdog.beats()
    deadline = time.monotonic() + watchdog.timeout + 3 * watchdog.interval
    while time.monotonic() < deadline and not watchdog.settled(since):
        time.sleep(watchdog.interval / 2)
