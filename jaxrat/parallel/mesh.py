"""Device mesh from config."""

from __future__ import annotations

import logging
import math
import socket
import zlib
from typing import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jaxrat.runtime.errors import ConfigError


def axis_sizes(axes: Sequence[tuple[str, int]], num_devices: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Resolve ``(name, size)`` pairs (one size may be -1 = the rest) against ``num_devices``."""
    names = tuple(str(a[0]) for a in axes)
    sizes = [int(a[1]) for a in axes]
    if len(set(names)) != len(names):
        raise ConfigError(f"config.mesh.axes repeats an axis name: {names}; give each axis a unique name.")
    free = [i for i, s in enumerate(sizes) if s == -1]
    if len(free) > 1:
        raise ConfigError(f"config.mesh.axes {tuple(axes)} has more than one -1; only one axis may take the rest.")
    fixed = math.prod(s for s in sizes if s != -1)
    if fixed <= 0 or any(s == 0 or s < -1 for s in sizes):
        raise ConfigError(f"config.mesh.axes {tuple(axes)} has a non-positive size; use positive sizes or -1.")
    if free:
        if num_devices % fixed:
            raise ConfigError(
                f"config.mesh.axes {tuple(axes)}: {num_devices} devices do not divide by {fixed}; "
                f"change the fixed axis sizes."
            )
        sizes[free[0]] = num_devices // fixed
    if math.prod(sizes) != num_devices:
        raise ConfigError(
            f"config.mesh.axes {tuple(axes)} needs {math.prod(sizes)} devices but there are {num_devices}; "
            f"set one axis to -1 or match the device count."
        )
    return names, tuple(sizes)


def make_mesh(axes: Sequence[tuple[str, int]], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Mesh over ``devices`` (default: every device of every process) with GSPMD (Auto) axes.

    Devices are ordered process-major, so the leading axes span hosts and trailing axes stay
    inside a host, where links are fastest.
    """
    devices = list(jax.devices() if devices is None else devices)
    devices.sort(key=lambda d: (d.process_index, d.id))
    names, sizes = axis_sizes(axes, len(devices))
    arr = np.array(devices, dtype=object).reshape(sizes)
    _warn_if_inner_axes_cross_hosts(arr, names)
    return Mesh(arr, names, axis_types=(AxisType.Auto,) * len(names))


def _warn_if_inner_axes_cross_hosts(arr: np.ndarray, names: tuple[str, ...]) -> None:
    """Axes after the first should stay inside one process (one node's fast links); say so if not."""
    if arr.ndim < 2:
        return
    for idx in np.ndindex(arr.shape[:1]):
        procs = {d.process_index for d in arr[idx].flat}
        if len(procs) > 1:
            logging.warning(
                "mesh axes %s span %d processes; collectives on them cross the network. Put the "
                "cross-node parallelism on the first axis (%r) and keep the others within a node.",
                names[1:], len(procs), names[0],
            )
            return


def processes_on_this_host() -> int:
    """How many processes of this job run on this machine (same host name); 1 when alone.

    A collective: every process must call it."""
    if jax.process_count() == 1:
        return 1
    from jax.experimental import multihost_utils

    me = np.int32(zlib.crc32(socket.gethostname().encode()) & 0x7FFFFFFF)
    everyone = np.asarray(multihost_utils.process_allgather(me))
    return int((everyone == me).sum())
