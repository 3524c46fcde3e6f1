"""Input worker processes: how many (:func:`resolve_num_workers`), and their exit: no shared memory
left behind, whatever ends the run.

Grain's process prefetch passes batches through shared memory. A batch is unlinked by whoever
drops it last, on a background thread pool; a worker killed mid-batch, or an unlink still queued
when the process exits, leaves the segment for Python's resource tracker, which warns of "leaked
shared_memory objects" at exit.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing.util  # noqa: F401  (registers its exit handler first, so ours runs before it)
import os
import signal
import threading
import time

from jaxrat.runtime.errors import ConfigError


def worker_ignores_job_signals(worker_index: int, worker_count: int) -> None:
    """Run in each input worker: SIGTERM and SIGINT are the parent's to act on.

    SLURM's preemption and a terminal's Ctrl-C signal every process of the job. A worker killed by
    them dies with batches in shared memory that nobody unlinks (the resource tracker then warns of
    "leaked shared_memory objects"); ignoring them, it keeps going until the parent, which saves
    and exits, stops it through Grain, which unlinks the batches still in flight. A parent that
    never stops them is ended by the scheduler's SIGKILL, which follows SIGTERM.
    """
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent()


def _exit_with_parent(period_s: float = 0.5) -> None:
    """End this worker once its parent is gone (a kill -9, a second SIGTERM).

    Ignoring SIGTERM, a worker whose parent died kept running and held the job's output pipe open
    (seen: a preempted demo's worker and resource tracker left behind). The parent-death signal
    is not used: it follows the parent *thread* that started the worker, which need not live as
    long as the run.
    """
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(period_s)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def worker_shared_memory_used() -> bool:
    """Whether this process has received batches in worker shared memory: Grain's process prefetch
    starts its unlink pool before the first one, and nothing else in a run makes shared memory."""
    from grain._src.python.ipc.shared_memory_array import SharedMemoryArray

    return SharedMemoryArray._del_thread_pool is not None


def finish_shared_memory_unlinks() -> None:
    """Wait until every worker batch dropped so far has had its shared memory unlinked.

    Grain's process prefetch unlinks a dropped batch's shared memory on a background thread pool;
    unlinks still queued there when the process exits never run, and Python's resource tracker then
    warns of "leaked shared_memory objects" (and removes them itself).
    """
    from grain._src.python.ipc.shared_memory_array import SharedMemoryArray

    pool = SharedMemoryArray._del_thread_pool
    if pool is not None:
        # Grain's pool has one thread (FIFO): once this no-op ran, every earlier unlink has. Bounded,
        # so a stuck unlink (a dead /dev/shm) cannot hang the exit.
        pool.apply_async(lambda: None).wait(10)


@atexit.register
def _unlink_in_place_from_now_on() -> None:
    # Runs before multiprocessing's own exit handler (registered earlier; atexit runs the last
    # first), which would SIGTERM the daemonic children still running and wait for them: input
    # workers ignore SIGTERM (see worker_ignores_job_signals), so an iterator nobody closed would
    # hang the exit there.
    import multiprocessing

    for child in multiprocessing.active_children():
        if child.daemon:
            child.kill()
            child.join(5)
    # Batches still referenced at exit (a preempted or failed run's last ones) are dropped during
    # interpreter teardown, when the pool's thread may no longer run: unlink those in the caller.
    from grain._src.python.ipc.shared_memory_array import SharedMemoryArray

    pool = SharedMemoryArray._del_thread_pool
    SharedMemoryArray._del_thread_pool = None
    SharedMemoryArray._outstanding_del_requests = None
    if pool is not None:
        pool.apply_async(lambda: None).wait(10)


def _available_ram_bytes() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 8 << 30


# A worker is a spawned Python process with numpy, PIL and grain imported (about 0.2 GiB resident
# seen in a demo run; 0.3 GiB leaves headroom) plus its output buffer.
WORKER_BASE_BYTES = 300 << 20


def resolve_num_workers(num_workers: int, ram_budget_gb: float, example_bytes: int, buffer_elements: int,
                        processes_on_host: int = 1) -> int:
    """``num_workers >= 0`` is used as given; ``-1`` picks as many as this process's share of the
    CPU cores (one left for the train step) and the RAM budget (``ram_budget_gb``, or a quarter of
    the available RAM shared by the ``processes_on_host`` training processes of this machine) allow.

    A process pinned to some cores (SLURM ``--cpus-per-task`` with task affinity) already sees
    only its share; an unpinned one divides the machine by ``processes_on_host``.
    """
    if num_workers >= 0:
        return int(num_workers)
    if num_workers != -1:
        raise ConfigError(f"config.data.num_workers={num_workers}; use 0 (in-process), N, or -1 (auto).")
    machine = os.cpu_count() or 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else machine
    share = max(1, processes_on_host)
    if cores >= machine:
        cores = max(1, cores // share)
    budget = ram_budget_gb * (1 << 30) if ram_budget_gb > 0 else _available_ram_bytes() / 4 / share
    per_worker = WORKER_BASE_BYTES + buffer_elements * example_bytes
    n = max(0, min(cores - 1, int(budget // per_worker)))
    logging.info("data: %d worker processes (%d cores for this process, RAM budget %.1f GiB, ~%.0f MiB each)",
                 n, cores, budget / (1 << 30), per_worker / (1 << 20))
    return n
