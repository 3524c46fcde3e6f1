"""Which launcher started this process, and who this process is: a pure function of config and environment.

One command works everywhere: ``python -m jaxrat.main ...`` alone, under ``srun`` (one task per
GPU or one task per node), ``mpirun``, ``torchrun``/``accelerate launch``, or LSF ``blaunch``/
``jsrun``. :func:`detect` touches neither JAX nor the network, so it is unit-tested with synthetic
environments; :func:`jaxrat.cluster.initialize` applies its answer.

Precedence: explicit config fields, then ``JAX_COORDINATOR_ADDRESS``/``JAX_COORDINATOR_PORT``/
``JAX_LOCAL_DEVICE_IDS``, then the launcher found in the environment. Launchers nest (torchrun
or mpirun inside a SLURM job), so the innermost one wins: torchrun, then Open MPI, then SLURM,
then LSF, then a plain single process.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

from jaxrat.cluster.launchers import KNOWN, NO_COORDINATOR, ClusterSpec, find_launcher, read_launcher
from jaxrat.runtime.errors import ConfigError

LAUNCHERS = ("auto", "single", "explicit", *KNOWN)


def config_field(dist_config: Any, key: str) -> Any:
    """A ``config.distributed`` field, with the config's "unset" sentinels ("" and -1) and absence read as None."""
    if dist_config is None:
        return None
    value = dist_config.get(key) if hasattr(dist_config, "get") else getattr(dist_config, key, None)
    if value is None or (isinstance(value, str) and value.strip() == ""):
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value == -1:
        return None
    return value


def _parse_device_ids(value: Any, source: str) -> tuple[int, ...]:
    items = value.split(",") if isinstance(value, str) else value if isinstance(value, (list, tuple)) else [value]
    try:
        return tuple(int(str(v).strip()) for v in items if str(v).strip() != "")
    except ValueError:
        raise ConfigError(f"{source}={value!r} is not a list of device ids; write it like '0,1,2,3'.") from None


def _split_address(address: str, source: str) -> tuple[str, int | None]:
    m = re.fullmatch(r"(\[[^\]]+\]|[^:\[\]]+)(?::(\d+))?", address.strip())
    if m is None:
        raise ConfigError(f"{source}={address!r} is not an address; write it as host:port, e.g. 10.0.0.1:61440.")
    return m.group(1), int(m.group(2)) if m.group(2) else None


def positive_int(value: Any, name: str, minimum: int) -> int:
    """``config.distributed.<name>`` as an int >= ``minimum``, or a ConfigError naming the field."""
    if isinstance(value, bool) or not isinstance(value, (int, str)) or not str(value).strip().isdigit():
        raise ConfigError(f"config.distributed.{name}={value!r} must be an integer >= {minimum}.")
    if int(value) < minimum:
        raise ConfigError(f"config.distributed.{name}={value!r} must be an integer >= {minimum}.")
    return int(value)


def detect(dist_config: Any = None, env: Mapping[str, str] | None = None) -> ClusterSpec:
    """Work out launcher, process count/id, coordinator and local devices without touching JAX.

    ``dist_config`` is ``config.distributed`` (or None); ``env`` defaults to ``os.environ``.
    Raises :class:`UserError` naming the missing or contradictory variable.
    """
    env = os.environ if env is None else env
    launcher = config_field(dist_config, "launcher") or "auto"
    if launcher not in LAUNCHERS:
        raise ConfigError(
            f"config.distributed.launcher={launcher!r} is unknown; use one of {', '.join(LAUNCHERS)}."
        )
    address = config_field(dist_config, "coordinator_address")
    num_processes = config_field(dist_config, "num_processes")
    process_id = config_field(dist_config, "process_id")
    if num_processes is not None:
        num_processes = positive_int(num_processes, "num_processes", 1)
    if process_id is not None:
        process_id = positive_int(process_id, "process_id", 0)
    given = [v is not None for v in (address, num_processes, process_id)]

    if launcher == "auto":
        if all(given):  # everything is explicit: a broken launcher environment cannot interfere
            launcher = "explicit"
        else:
            launcher = find_launcher(env) or ("explicit" if any(given) else "single")
    if launcher in KNOWN:
        spec = read_launcher(launcher, env)
    elif launcher == "explicit":
        if num_processes is None:
            raise ConfigError(
                "config.distributed.num_processes is not set but no launcher was detected; set "
                "--config.distributed.num_processes=N (and process_id, coordinator_address) for every process."
            )
        if num_processes > 1 and process_id is None:
            raise ConfigError(
                "config.distributed.process_id is not set; give every process its own "
                f"--config.distributed.process_id in 0..{num_processes - 1}."
            )
        spec = ClusterSpec("explicit", num_processes, process_id or 0)
    else:  # "single"
        if (num_processes or 1) > 1:
            raise ConfigError(
                f"config.distributed.launcher='single' contradicts num_processes={num_processes}; "
                "set launcher='auto' or 'explicit' for a multi-process run."
            )
        spec = ClusterSpec("single", 1, 0)
    return _apply_overrides(spec, dist_config, env, address, num_processes, process_id)


def _apply_overrides(
    spec: ClusterSpec, dist_config: Any, env: Mapping[str, str],
    address: str | None, num_processes: int | None, process_id: int | None,
) -> ClusterSpec:
    n = num_processes if num_processes is not None else spec.num_processes
    pid = process_id if process_id is not None else spec.process_id
    if not 0 <= pid < n:
        raise ConfigError(f"process_id={pid} is not below num_processes={n}; give each process an id in 0..{n - 1}.")
    # The coordinator: config, then jax's own env variable, then the launcher's.
    source = "config.distributed.coordinator_address"
    if address is None and env.get("JAX_COORDINATOR_ADDRESS", "").strip():
        address, source = env["JAX_COORDINATOR_ADDRESS"], "JAX_COORDINATOR_ADDRESS"
    coordinator = spec.coordinator_address
    if address is not None:
        host, port = _split_address(address, source)
        if port is None and coordinator is not None:
            port = int(coordinator.rsplit(":", 1)[1])  # keep the launcher's port
        coordinator = f"{host}:{port}" if port is not None else host
    port_override = config_field(dist_config, "coordinator_port")
    port_source = "config.distributed.coordinator_port"
    if port_override is None and env.get("JAX_COORDINATOR_PORT", "").strip():
        port_override, port_source = env["JAX_COORDINATOR_PORT"].strip(), "JAX_COORDINATOR_PORT"
    if port_override is not None:
        if not str(port_override).isdigit() or not 0 < int(port_override) < 65536:
            raise ConfigError(f"{port_source}={port_override!r} is not a TCP port; use a number in 1-65535.")
        if address is not None and _split_address(address, source)[1] not in (None, int(port_override)):
            raise ConfigError(
                f"{source}={address!r} and {port_source}={port_override} name different ports; set only one."
            )
        if coordinator is not None:
            coordinator = f"{_split_address(coordinator, source)[0]}:{int(port_override)}"
    if n > 1:
        if coordinator is None:
            why = NO_COORDINATOR.get(spec.launcher, f"{n} processes need a coordinator but none is known")
            raise ConfigError(
                f"{why}; set JAX_COORDINATOR_ADDRESS=<host of process 0>:<port> in every process "
                "or --config.distributed.coordinator_address."
            )
        if _split_address(coordinator, source)[1] is None:
            raise ConfigError(
                f"the coordinator {coordinator!r} has no port; write {source} as host:port or set "
                "config.distributed.coordinator_port."
            )
    ids = spec.local_device_ids
    if config_field(dist_config, "local_device_ids") is not None:
        ids = _parse_device_ids(config_field(dist_config, "local_device_ids"), "config.distributed.local_device_ids")
    elif env.get("JAX_LOCAL_DEVICE_IDS", "").strip():
        ids = _parse_device_ids(env["JAX_LOCAL_DEVICE_IDS"], "JAX_LOCAL_DEVICE_IDS")
    launcher = spec.launcher if (n > 1 or spec.launcher != "explicit") else "single"
    return ClusterSpec(launcher, n, pid, coordinator if n > 1 else None, ids)
