"""Settings of XLA's CPU client that must be made before JAX creates it."""

from __future__ import annotations

import os


def pin_cpu_parallelism(shards: int) -> None:
    """Give XLA's CPU client the same thread count on every topology of a ``shards``-shard run.

    XLA partitions elementwise kernels by the client's thread count, ``max(NPROC, devices)``, and
    a kernel split differently rounds some transcendental functions differently. ``NPROC`` at least
    ``shards`` (never fewer than the cores) makes that count independent of the devices, since a
    run never has more devices than shards. Only takes effect before JAX's CPU client exists; an
    ``NPROC`` the user set is kept.
    """
    if shards > 0 and "NPROC" not in os.environ:
        os.environ["NPROC"] = str(max(shards, os.cpu_count() or 1))
