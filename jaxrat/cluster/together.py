"""Start a program's first run on every process at once, whatever each one's compile time.

On CPU, JAX's collectives (Gloo) set up a communicator the first time a compiled program runs one,
and give up after 30 s (``Gloo context initialization failed: DEADLINE_EXCEEDED``) when a peer has
not arrived: two processes compiling the same step on a loaded machine can finish minutes apart.
So in a multi-process run the first call of a jitted step is compiled ahead (``lower().compile()``;
JAX reuses that executable for the call) and the processes then meet at a barrier of the
coordination service, which has no such deadline, before running it. Later calls go straight
through. GPUs' NCCL waits longer, but the barrier costs nothing there either.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

import jax

# A barrier's wait: longer than any compile, yet finite so a hang still ends. A dead peer is
# caught sooner by the peer watchdog (jaxrat.cluster.peers).
BARRIER_TIMEOUT_S = 3600
_ids = itertools.count()


def meet(name: str, timeout_s: float = BARRIER_TIMEOUT_S) -> None:
    """Wait until every process of the run reaches the barrier ``name`` (no-op in one process)."""
    if jax.process_count() == 1:
        return
    from jax._src.distributed import global_state  # JAX's client, which jax.distributed does not expose

    if global_state.client is None:
        return
    barrier = f"jaxrat/{name}/{next(_ids)}"  # every process makes the same calls in the same order
    global_state.client.wait_at_barrier(barrier, int(timeout_s * 1000))


def compiled_together(fn: Any, name: str) -> Callable[..., Any]:
    """``fn`` (a jitted function) whose first call compiles, meets the other processes, then runs.

    The first call logs the compilation's start and its time: on a CPU a full-size model compiles for
    minutes, and a silent wait that long reads as a hang."""
    first = True

    def call(*args: Any) -> Any:
        nonlocal first
        if not first:
            return fn(*args)
        first = False
        logging.info("compiling the %s (XLA; a rerun of this config reads it from the compilation cache)", name)
        t0 = time.perf_counter()
        if jax.process_count() > 1:
            fn.lower(*args).compile()
            logging.info("%s compiled in %.1f s; waiting for the other processes to start it together", name,
                         time.perf_counter() - t0)
            meet(name)
            return fn(*args)
        out = fn(*args)  # returns once compiled and dispatched: the time is the compilation's
        logging.info("%s compiled in %.1f s", name, time.perf_counter() - t0)
        return out

    return call
