"""Join the job: ``jax.distributed`` initialisation from :func:`detect`'s answer, with checks that speak.

JAX reports an unresolvable coordinator host, a busy coordinator port and a missing peer by
crashing with a C++ stack trace (or a segfault); :func:`initialize` checks or times them first and
ends with one sentence instead. JAX is imported inside the functions so that importing
:mod:`jaxrat.cluster` stays cheap for tools that only render job scripts.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from jaxrat.cluster import peers
from jaxrat.cluster.detect import ClusterSpec, config_field, detect, positive_int
from jaxrat.runtime.errors import UserError

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class WorldInfo:
    """What this process learnt about the job it belongs to."""

    launcher: str
    process_index: int
    process_count: int
    coordinator: str | None
    local_device_ids: tuple[int, ...] | None = None
    local_device_count: int = 0
    global_device_count: int = 0

    def summary(self) -> str:
        """One log line: launcher, process i/n, devices and coordinator."""
        ids = "all" if self.local_device_ids is None else ",".join(map(str, self.local_device_ids))
        return (
            f"launcher={self.launcher} process={self.process_index}/{self.process_count} "
            f"local_devices={self.local_device_count} local_device_ids={ids} "
            f"global_devices={self.global_device_count} coordinator={self.coordinator or '-'}"
        )


def _preflight(spec: ClusterSpec) -> None:
    """Turn the failures jax reports by crashing (bad host, busy port) into one sentence."""
    host, port = spec.coordinator_address.rsplit(":", 1)  # type: ignore[union-attr]
    host = host.strip("[]")
    try:
        socket.getaddrinfo(host, int(port))
    except socket.gaierror:
        raise UserError(
            f"the coordinator host {host!r} ({spec.launcher}) does not resolve on this machine; "
            "fix the host name or set config.distributed.coordinator_address to an IP address."
        ) from None
    if spec.process_id != 0:
        return
    # Process 0 hosts the coordinator; gRPC segfaults when the port is taken, so check first.
    family = socket.AF_INET6 if socket.has_ipv6 else socket.AF_INET
    probe = socket.socket(family, socket.SOCK_STREAM)
    try:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("::" if family == socket.AF_INET6 else "", int(port)))
    except OSError as err:
        raise UserError(
            f"the coordinator port {port} is already in use on this host ({err.strerror}); another job or "
            "step is using it: set config.distributed.coordinator_port (or JAX_COORDINATOR_PORT) to a free port."
        ) from None
    finally:
        probe.close()


@contextmanager
def _watchdog(spec: ClusterSpec, timeout: int) -> Iterator[None]:
    """Exit with one clear sentence when the processes have not all met within ``timeout`` s.

    jax's own timeout aborts the process with a C++ stack trace, so ours fires first.
    """
    if spec.process_id == 0:
        why = (f"process 0 waited {timeout} s at coordinator {spec.coordinator_address} but not all "
               f"{spec.num_processes} processes connected; check that all were launched with the same "
               "process count and coordinator, or raise config.distributed.initialization_timeout.")
    else:
        why = (f"process {spec.process_id} could not join the coordinator {spec.coordinator_address} within "
               f"{timeout} s; check that process 0 is running and reachable from this host, or raise "
               "config.distributed.initialization_timeout.")

    def fire() -> None:
        sys.stderr.write(f"ERROR: distributed initialization timed out ({spec.launcher}): {why}\n")
        sys.stderr.flush()
        os._exit(2)

    timer = threading.Timer(timeout, fire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def initialize(dist_config: Any = None) -> WorldInfo:
    """Initialise ``jax.distributed`` from the config or the environment and log the world.

    Must run before any other JAX use (device queries included). A single process needs no
    coordinator and skips ``jax.distributed`` entirely. Every process logs one line. With several
    processes a :mod:`~jaxrat.cluster.peers` watchdog starts too: when a process is silent for
    ``config.distributed.heartbeat_timeout`` seconds, the others exit for requeue naming it.
    """
    import jax
    from jax._src import xla_bridge

    spec = detect(dist_config)
    if spec.num_processes > 1 and not jax.distributed.is_initialized():
        if xla_bridge.backends_are_initialized():
            raise UserError(
                "JAX was used before jaxrat.cluster.initialize, so it can no longer join a multi-process "
                "job; call initialize() first, before any jax.devices() or computation."
            )
        timeout = positive_int(config_field(dist_config, "initialization_timeout") or 300, "initialization_timeout", 1)
        heartbeat = positive_int(config_field(dist_config, "heartbeat_timeout") or 100, "heartbeat_timeout", 1)
        _preflight(spec)
        logger.info("%s: process %d/%d joining coordinator %s (timeout %d s)", spec.launcher,
                    spec.process_id, spec.num_processes, spec.coordinator_address, timeout)
        with _watchdog(spec, timeout):
            jax.distributed.initialize(
                coordinator_address=spec.coordinator_address,
                num_processes=spec.num_processes,
                process_id=spec.process_id,
                local_device_ids=list(spec.local_device_ids) if spec.local_device_ids is not None else None,
                cluster_detection_method="deactivate",
                # Our watchdogs fire first and explain; jax's own abort with a stack trace.
                initialization_timeout=timeout + 60,
                heartbeat_timeout_seconds=heartbeat + 60,
            )
        from jax._src.distributed import global_state  # JAX's client, which jax.distributed does not expose

        peers.start_watchdog(global_state.client, spec.process_id, spec.num_processes, heartbeat)
    elif spec.local_device_ids is not None and not xla_bridge.backends_are_initialized():
        visible = ",".join(map(str, spec.local_device_ids))
        jax.config.update("jax_cuda_visible_devices", visible)
        jax.config.update("jax_rocm_visible_devices", visible)
    info = WorldInfo(
        launcher=spec.launcher,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        coordinator=spec.coordinator_address,
        local_device_ids=spec.local_device_ids,
        local_device_count=jax.local_device_count(),
        global_device_count=jax.device_count(),
    )
    logger.info("%s", info.summary())
    return info
