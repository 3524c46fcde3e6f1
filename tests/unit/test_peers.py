"""The lost-peer watchdog's judgement, with a fake key-value store and a fake clock (no processes)."""

from __future__ import annotations

from jaxrat.cluster.peers import PeerWatchdog


class FakeStore:
    """The two calls of JAX's distributed client the watchdog uses, plus a switch to make it unreachable."""

    def __init__(self) -> None:
        self.kv: dict[str, str] = {}
        self.down = False

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
        if self.down:
            raise RuntimeError("UNAVAILABLE: Socket closed")
        self.kv[key] = value

    def key_value_dir_get(self, prefix: str) -> list[tuple[str, str]]:
        if self.down:
            raise RuntimeError("UNAVAILABLE: Socket closed")
        return [(k, v) for k, v in self.kv.items() if k.startswith(prefix)]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def three(store: FakeStore, clock: Clock) -> list[PeerWatchdog]:
    dogs = [PeerWatchdog(store, i, 3, timeout=10, on_lost=print, clock=clock) for i in range(3)]
    for i in range(3):
        store.kv[f"jaxrat/peers/who/{i}"] = f"host n{i}, pid {100 + i}"
    return dogs


def beat(dogs: list[PeerWatchdog], clock: Clock, seconds: float) -> None:
    for _ in range(int(seconds)):
        clock.now += 1
        for d in dogs:
            d.exchange()


def test_beating_peers_are_never_lost():
    store, clock = FakeStore(), Clock()
    dogs = three(store, clock)
    beat(dogs, clock, 60)
    assert [d.lost() for d in dogs] == [None, None, None]


def test_a_silent_peer_is_named_after_the_timeout_and_not_before():
    store, clock = FakeStore(), Clock()
    dogs = three(store, clock)
    beat(dogs, clock, 5)
    beat(dogs[:2], clock, 10)  # process 2 died; its last beat reached the others at the first of these
    assert dogs[0].lost() is None
    beat(dogs[:2], clock, 2)
    sentence = dogs[0].lost()
    assert sentence.startswith("process 2 of 3 (host n2, pid 102) has not been heard from for 10 s")
    assert "process 0 stops with exit status 42" in sentence
    assert dogs[1].lost().startswith("process 2 of 3")


def test_a_peer_that_finished_on_purpose_is_not_lost():
    store, clock = FakeStore(), Clock()
    dogs = three(store, clock)
    beat(dogs, clock, 3)
    dogs[2].finish()
    beat(dogs[:2], clock, 60)
    assert dogs[0].lost() is None and dogs[1].lost() is None


def test_no_answer_from_the_coordinator_is_process_0_lost():
    store, clock = FakeStore(), Clock()
    dogs = three(store, clock)
    beat(dogs, clock, 3)
    store.down = True  # process 0, which hosts the key-value store, is gone
    beat(dogs[1:], clock, 11)
    assert dogs[1].lost().startswith("process 0 of 3 (host n0, pid 100) has not been heard from for 10 s")


def test_settled_once_every_peer_beat_twice_again():
    store, clock = FakeStore(), Clock()
    dogs = three(store, clock)
    beat(dogs, clock, 2)
    since = dogs[0].beats()
    assert not dogs[0].settled(since)
    beat(dogs, clock, 1)
    assert not dogs[0].settled(since)  # one new beat may predate a peer's death (next test)
    beat(dogs, clock, 1)
    assert dogs[0].settled(since)


def test_a_dead_peers_last_beat_read_after_the_error_does_not_settle():
    """Peer 2 publishes a beat and dies before process 0 reads it; process 0's collective fails at once."""
    store, clock = FakeStore(), Clock()
    dogs = three(store, clock)
    beat(dogs, clock, 2)
    dogs[2].exchange()  # its last beat, not yet read by process 0
    since = dogs[0].beats()  # the error: process 0 waits for every peer to beat again
    beat(dogs[:2], clock, 3)  # process 0 now reads peer 2's last beat; peer 2 is gone
    assert not dogs[0].settled(since)


def test_once_process_0_finished_its_missing_store_blames_no_one():
    store, clock = FakeStore(), Clock()
    dogs = three(store, clock)
    beat(dogs, clock, 3)
    dogs[0].finish()
    beat(dogs[1:], clock, 1)
    store.down = True  # process 0 ended normally, taking the store with it
    beat(dogs[1:], clock, 60)
    assert dogs[1].lost() is None and dogs[2].lost() is None


def test_a_stopped_watchdog_waits_for_a_call_in_flight_then_never_calls_the_client_again():
    import threading
    import time

    store, clock = FakeStore(), Clock()
    dogs = three(store, clock)
    beat(dogs, clock, 3)
    inside, release = threading.Event(), threading.Event()
    real_get = store.key_value_dir_get

    def slow_get(prefix):  # a call that is inside the client when the process starts to exit
        inside.set()
        release.wait(5)
        return real_get(prefix)

    store.key_value_dir_get = slow_get
    caller = threading.Thread(target=dogs[0].exchange)
    caller.start()
    inside.wait(5)
    stopper = threading.Thread(target=dogs[0].stop)
    stopper.start()
    time.sleep(0.2)
    assert stopper.is_alive()  # stop() waits for the call to come back out of the client
    release.set()
    caller.join(5)
    stopper.join(5)
    assert not stopper.is_alive()
    store.down = True  # any further call would raise inside exchange; none is made
    calls = []
    store.key_value_set = lambda *a, **k: calls.append(a)
    dogs[0].exchange()
    clock.now += 60
    assert calls == [] and dogs[0].lost() is None
