"""Find out which launcher started this process and initialise ``jax.distributed`` from it.

One command works everywhere: ``python -m jaxrat.main ...`` alone, under ``srun`` (one task per
GPU or one task per node), ``mpirun``, ``torchrun``/``accelerate launch``, or LSF ``blaunch``/
``jsrun``. :func:`detect` is a pure function of the config and the environment (unit-tested with
synthetic environments); :func:`initialize` applies it and must run before any other JAX use.

Precedence: explicit config fields, then ``JAX_COORDINATOR_ADDRESS``/``JAX_COORDINATOR_PORT``/
``JAX_LOCAL_DEVICE_IDS``, then the launcher found in the environment. Launchers nest (torchrun
or mpirun inside a SLURM job), so the innermost one wins: torchrun, then Open MPI, then SLURM,
then LSF, then a plain single process.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import signal
import socket
import sys
import threading
import zlib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from jaxrat.errors import ConfigError, UserError

logger = logging.getLogger(__name__)

LAUNCHERS = ("auto", "single", "explicit", "torchrun", "mpi", "slurm", "lsf")
# jax picks coordinator ports in [61440, 65535], above Linux's ephemeral range; so do we.
_PORT_BASE, _PORT_SPAN = 61440, 4096


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """What :func:`detect` found: the arguments for ``jax.distributed.initialize``."""

    launcher: str
    num_processes: int
    process_id: int
    coordinator_address: str | None = None
    # Device ordinals (within CUDA_VISIBLE_DEVICES) this process drives; None means all visible.
    local_device_ids: tuple[int, ...] | None = None


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


# ----------------------------------------------------------------------------- parsing helpers


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a SLURM host list: ``"gpu[01-03,07],login-a"`` -> ``gpu01 gpu02 gpu03 gpu07 login-a``.

    Several bracket groups in one name (``r[1-2]n[1-2]``) expand to their product; zero padding
    follows the written width (``[08-10]`` -> 08 09 10).
    """
    names: list[str] = []
    for item in _split_top_level(hostlist.strip()):
        names.extend(_expand_item(item, hostlist))
    return names


def _split_top_level(text: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [it.strip() for it in items if it.strip()]


def _expand_item(item: str, whole: str) -> list[str]:
    m = re.match(r"^([^\[\]]*)\[([^\[\]]*)\](.*)$", item)
    if not m:
        if "[" in item or "]" in item:
            raise UserError(f"cannot parse the host list {whole!r}: unbalanced brackets in {item!r}.")
        return [item]
    prefix, ranges, rest = m.groups()
    out = []
    for part in ranges.split(","):
        lo, _, hi = part.strip().partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise UserError(f"cannot parse the host list {whole!r}: bad range {part!r}.")
        width = len(lo)
        for n in range(int(lo), int(hi or lo) + 1):
            for tail in _expand_item(rest, whole) if rest else [""]:
                out.append(f"{prefix}{n:0{width}d}{tail}")
    return out


def expand_tasks_per_node(spec: str) -> list[int]:
    """Expand SLURM's compressed per-node counts: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise UserError(f"cannot parse the tasks-per-node value {spec!r} (expected e.g. '2(x3),1').")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts


def _count_devices(value: str | None) -> int | None:
    """Number of devices in CUDA_VISIBLE_DEVICES-like lists ("0,1", "GPU-uuid,..."); None if unset."""
    if value is None:
        return None
    value = value.strip()
    if value in ("", "NoDevFiles", "-1"):
        return 0
    return len([v for v in value.split(",") if v.strip()])


# ------------------------------------------------------------------------- environment access


class _Env:
    """Read access to an environment that names the launcher in every error."""

    def __init__(self, env: Mapping[str, str], launcher: str):
        self.env, self.launcher = env, launcher

    def get(self, name: str) -> str | None:
        v = self.env.get(name)
        return None if v is None or v.strip() == "" else v.strip()

    def require(self, name: str, why: str = "") -> str:
        v = self.get(name)
        if v is None:
            raise UserError(
                f"the {self.launcher} environment is incomplete: {name} is not set{why}; "
                f"launch through {self.launcher} itself, or set config.distributed explicitly "
                f"(coordinator_address, num_processes, process_id)."
            )
        return v

    def int(self, name: str, default: int | None = None) -> int:
        v = self.get(name) if default is not None else self.require(name)
        if v is None:
            return default  # type: ignore[return-value]
        try:
            return int(v)
        except ValueError:
            raise UserError(f"{name}={v!r} in the {self.launcher} environment is not an integer.") from None


def _port_from(text: str) -> int:
    """A stable coordinator port from any job identifier."""
    n = int(text) if text.isdigit() else zlib.crc32(text.encode())
    return _PORT_BASE + n % _PORT_SPAN


def _contradiction(launcher: str, what: str) -> UserError:
    return UserError(f"the {launcher} environment contradicts itself: {what}; launch through {launcher} itself "
                     "or set config.distributed explicitly.")


# ------------------------------------------------------------------------------- device split


def _local_device_ids(env: _Env, tasks_here: int | None, local_rank: int) -> tuple[int, ...] | None:
    """Which visible GPUs this process drives when ``tasks_here`` processes share a node.

    Returns None (use every visible device) when there is one process per node, when the launcher
    already restricted each task's visibility (``--gpus-per-task``, ``--gpu-bind``), or when no
    GPU is visible (CPU runs). Otherwise the visible GPUs are split in equal contiguous chunks.
    """
    visible = _count_devices(env.env.get("CUDA_VISIBLE_DEVICES"))
    if visible is None:
        visible = _count_devices(env.get("SLURM_STEP_GPUS") or env.get("SLURM_JOB_GPUS"))
    on_node = env.get("SLURM_GPUS_ON_NODE")
    on_node_n = int(on_node) if on_node and on_node.isdigit() else None
    if visible is None and on_node_n is not None:
        visible = on_node_n
    if not visible or not tasks_here or tasks_here <= 1:
        return None
    if env.get("SLURM_GPUS_PER_TASK") or (on_node_n is not None and visible < on_node_n):
        return None  # SLURM gave each task its own GPUs already
    if visible < tasks_here:
        if on_node_n is None or visible < on_node_n:
            return None
        raise UserError(
            f"{tasks_here} processes on this node share {visible} visible GPUs; launch one process per "
            "GPU (e.g. --ntasks-per-node=<gpus>) or one per node, or set config.distributed.local_device_ids."
        )
    if visible % tasks_here:
        raise UserError(
            f"{visible} visible GPUs cannot be split evenly over {tasks_here} processes on this node; "
            "use a number of processes per node that divides the GPU count, or set "
            "config.distributed.local_device_ids."
        )
    per = visible // tasks_here
    return tuple(range(local_rank * per, (local_rank + 1) * per))


# ---------------------------------------------------------------------------------- launchers


def _detect_slurm(e: _Env) -> ClusterSpec:
    job = e.require("SLURM_JOB_ID")
    step = e.get("SLURM_STEP_ID") or e.get("SLURM_STEPID")
    if step is None:
        # The batch script itself (or an salloc shell): only a single process is possible here.
        ntasks = e.int("SLURM_NTASKS", 1)
        if ntasks > 1:
            raise UserError(
                f"this process runs in the batch script of SLURM job {job}, which has {ntasks} tasks, "
                "but not inside a job step; start it with `srun python -m jaxrat.main ...` so that "
                "every task runs (or request --ntasks=1)."
            )
        return ClusterSpec("slurm", 1, 0)
    nodes = expand_hostlist(e.require("SLURM_STEP_NODELIST", " inside an srun step"))
    ntasks = e.int("SLURM_STEP_NUM_TASKS") if e.get("SLURM_STEP_NUM_TASKS") else e.int("SLURM_NTASKS")
    procid, localid = e.int("SLURM_PROCID"), e.int("SLURM_LOCALID")
    if not 0 <= procid < ntasks:
        raise _contradiction("slurm", f"SLURM_PROCID={procid} is not below the task count {ntasks}")
    tpn_text = e.get("SLURM_STEP_TASKS_PER_NODE") or e.get("SLURM_TASKS_PER_NODE")
    tasks_here: int | None = ntasks if len(nodes) == 1 else None
    if tpn_text:
        tpn = expand_tasks_per_node(tpn_text)
        if len(tpn) != len(nodes) or sum(tpn) != ntasks:
            raise _contradiction(
                "slurm", f"tasks per node {tpn_text!r} do not match {len(nodes)} nodes and {ntasks} tasks"
            )
        here = e.get("SLURMD_NODENAME")
        if here in nodes:
            index = nodes.index(here)
        else:
            index = e.int("SLURM_NODEID", 0)
            if index >= len(nodes):
                raise _contradiction("slurm", f"SLURM_NODEID={index} but the step has {len(nodes)} nodes")
        tasks_here = tpn[index]
    if tasks_here is not None and not 0 <= localid < tasks_here:
        raise _contradiction("slurm", f"SLURM_LOCALID={localid} but this node runs {tasks_here} tasks")
    # Concurrent steps of one allocation share SLURM_JOB_ID: fold the step id in so their
    # coordinators do not collide (step 0 keeps jax's own choice, job_id % 4096 + 61440).
    job_n, step_n = (int(x) if x.isdigit() else zlib.crc32(x.encode()) for x in (job, step))
    port = _PORT_BASE + (job_n + 1031 * step_n) % _PORT_SPAN  # 1031 is odd: 4096 steps, 4096 ports
    return ClusterSpec(
        "slurm", ntasks, procid, f"{nodes[0]}:{port}", _local_device_ids(e, tasks_here, localid)
    )


def _detect_mpi(e: _Env) -> ClusterSpec:
    size, rank = e.int("OMPI_COMM_WORLD_SIZE"), e.int("OMPI_COMM_WORLD_RANK")
    local_rank = e.int("OMPI_COMM_WORLD_LOCAL_RANK")
    local_size = e.int("OMPI_COMM_WORLD_LOCAL_SIZE", 0) or None
    if not 0 <= rank < size:
        raise _contradiction("mpi", f"OMPI_COMM_WORLD_RANK={rank} is not below OMPI_COMM_WORLD_SIZE={size}")
    uri = e.get("OMPI_MCA_orte_hnp_uri")
    if uri:  # Open MPI <= 4: "1531576320.0;tcp://10.96.0.1,10.148.0.1:34911"
        m = re.search(r"tcp://([^,:;/]+)|tcp6://\[([^,\]]+)", uri)
        if m is None:
            raise UserError(f"cannot read the launcher address from OMPI_MCA_orte_hnp_uri={uri!r}.")
        host = m.group(1) or f"[{m.group(2)}]"
        jobid = uri.split(".", 1)[0]
        port = _port_from(str(int(jobid) // 4096) if jobid.isdigit() else jobid)
    elif local_size == size:  # Open MPI 5 (PMIx): no launcher URI, but all ranks are on this host
        host, port = "127.0.0.1", _port_from(e.get("PMIX_NAMESPACE") or e.get("PMIX_ID") or "ompi")
    else:  # Open MPI 5 across hosts publishes no address of rank 0: the user must give one
        return ClusterSpec("mpi", size, rank, None, _local_device_ids(e, local_size, local_rank))
    return ClusterSpec("mpi", size, rank, f"{host}:{port}", _local_device_ids(e, local_size, local_rank))


def _detect_torchrun(e: _Env) -> ClusterSpec:
    world, rank = e.int("WORLD_SIZE"), e.int("RANK")
    addr, master_port = e.require("MASTER_ADDR"), e.int("MASTER_PORT")
    if not 0 <= rank < world:
        raise _contradiction("torchrun", f"RANK={rank} is not below WORLD_SIZE={world}")
    local_rank = e.int("LOCAL_RANK", 0)
    local_world = e.int("LOCAL_WORLD_SIZE", 0) or None
    if local_world is not None and not 0 <= local_rank < local_world:
        raise _contradiction("torchrun", f"LOCAL_RANK={local_rank} is not below LOCAL_WORLD_SIZE={local_world}")
    # torchrun's agent (and accelerate's) already listens on MASTER_PORT with its own store.
    port = master_port + 1 if e.get("TORCHELASTIC_RUN_ID") else master_port
    return ClusterSpec("torchrun", world, rank, f"{addr}:{port}", _local_device_ids(e, local_world, local_rank))


def _lsf_hosts(e: _Env) -> list[tuple[str, int]]:
    """(host, slots) pairs of the job in LSF's order, from LSB_MCPU_HOSTS or else LSB_HOSTS."""
    mcpu = e.get("LSB_MCPU_HOSTS")
    if mcpu is None and e.get("LSB_HOSTS"):
        counts: dict[str, int] = {}
        for h in e.require("LSB_HOSTS").split():  # one entry per slot
            counts[h] = counts.get(h, 0) + 1
        return list(counts.items())
    parts = e.require("LSB_MCPU_HOSTS").split()
    if not parts or len(parts) % 2 or not all(p.isdigit() for p in parts[1::2]):
        raise UserError(f"cannot parse LSB_MCPU_HOSTS={mcpu!r} (expected 'host1 n1 host2 n2 ...').")
    return [(h, int(n)) for h, n in zip(parts[::2], parts[1::2])]


def _detect_lsf(e: _Env) -> ClusterSpec:
    job = e.require("LSB_JOBID")
    hosts = _lsf_hosts(e)
    slots = sum(n for _, n in hosts)
    port = _port_from(job)
    if e.get("JSM_NAMESPACE_RANK") is not None:  # jsrun
        size, rank = e.int("JSM_NAMESPACE_SIZE"), e.int("JSM_NAMESPACE_RANK")
        local_rank = e.int("JSM_NAMESPACE_LOCAL_RANK", 0)
        local_size = e.int("JSM_NAMESPACE_LOCAL_SIZE", 0) or None
    elif e.get("LSF_PM_TASKID") is not None:  # blaunch: 1-based task ids, one per slot in host order
        rank, size = e.int("LSF_PM_TASKID") - 1, e.int("LSB_DJOB_NUMPROC", slots)
        start, local_rank, local_size = 0, 0, None
        for _, n in hosts:
            if start <= rank < start + n:
                local_rank, local_size = rank - start, n
            start += n
    else:  # the job script itself
        if len(hosts) > 1:
            raise UserError(
                f"this process runs in the script of LSF job {job}, which spans {len(hosts)} hosts, but was "
                "not started per task; start it with `blaunch python -m jaxrat.main ...` (or jsrun/mpirun)."
            )
        return ClusterSpec("lsf", 1, 0)
    if not 0 <= rank < size:
        raise _contradiction("lsf", f"task rank {rank} is not below the task count {size}")
    coordinator = f"{hosts[0][0]}:{port}"
    return ClusterSpec("lsf", size, rank, coordinator, _local_device_ids(e, local_size, local_rank))


_NO_COORDINATOR = {"mpi": "Open MPI 5 does not publish the address of rank 0 when the ranks span several hosts"}


def _is_torchrun(env: Mapping[str, str]) -> bool:
    return any(k in env for k in ("TORCHELASTIC_RUN_ID", "WORLD_SIZE")) or ("RANK" in env and "MASTER_ADDR" in env)


_DETECTORS = {
    "torchrun": (_is_torchrun, _detect_torchrun),
    "mpi": (lambda env: "OMPI_COMM_WORLD_SIZE" in env or "OMPI_MCA_orte_hnp_uri" in env, _detect_mpi),
    "slurm": (lambda env: "SLURM_JOB_ID" in env, _detect_slurm),
    "lsf": (lambda env: "LSB_JOBID" in env, _detect_lsf),
}


# ----------------------------------------------------------------------------- config overrides


def _cfg(dist_config: Any, key: str) -> Any:
    """A config field, with the config's "unset" sentinels ("" and -1) and absence read as None."""
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


def _positive_int(value: Any, name: str, minimum: int) -> int:
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
    launcher = _cfg(dist_config, "launcher") or "auto"
    if launcher not in LAUNCHERS:
        raise ConfigError(
            f"config.distributed.launcher={launcher!r} is unknown; use one of {', '.join(LAUNCHERS)}."
        )
    address = _cfg(dist_config, "coordinator_address")
    num_processes = _cfg(dist_config, "num_processes")
    process_id = _cfg(dist_config, "process_id")
    if num_processes is not None:
        num_processes = _positive_int(num_processes, "num_processes", 1)
    if process_id is not None:
        process_id = _positive_int(process_id, "process_id", 0)
    given = [v is not None for v in (address, num_processes, process_id)]

    if launcher == "auto":
        if all(given):  # everything is explicit: a broken launcher environment cannot interfere
            launcher = "explicit"
        else:
            found = next((name for name, (present, _) in _DETECTORS.items() if present(env)), None)
            launcher = found or ("explicit" if any(given) else "single")
    if launcher in _DETECTORS:
        spec = _DETECTORS[launcher][1](_Env(env, launcher))
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
    port_override = _cfg(dist_config, "coordinator_port")
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
            why = _NO_COORDINATOR.get(spec.launcher, f"{n} processes need a coordinator but none is known")
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
    if _cfg(dist_config, "local_device_ids") is not None:
        ids = _parse_device_ids(_cfg(dist_config, "local_device_ids"), "config.distributed.local_device_ids")
    elif env.get("JAX_LOCAL_DEVICE_IDS", "").strip():
        ids = _parse_device_ids(env["JAX_LOCAL_DEVICE_IDS"], "JAX_LOCAL_DEVICE_IDS")
    launcher = spec.launcher if (n > 1 or spec.launcher != "explicit") else "single"
    return ClusterSpec(launcher, n, pid, coordinator if n > 1 else None, ids)


# ------------------------------------------------------------------------------- initialization


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
    coordinator and skips ``jax.distributed`` entirely. Every process logs one line.
    """
    import jax
    from jax._src import xla_bridge

    spec = detect(dist_config)
    if spec.num_processes > 1 and not jax.distributed.is_initialized():
        if xla_bridge.backends_are_initialized():
            raise UserError(
                "JAX was used before jaxrat.distributed.initialize, so it can no longer join a multi-process "
                "job; call initialize() first, before any jax.devices() or computation."
            )
        timeout = _positive_int(_cfg(dist_config, "initialization_timeout") or 300, "initialization_timeout", 1)
        heartbeat = _positive_int(_cfg(dist_config, "heartbeat_timeout") or 100, "heartbeat_timeout", 1)
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
                # Ours fires first and explains; jax's own would abort with a stack trace.
                initialization_timeout=timeout + 60,
                heartbeat_timeout_seconds=heartbeat,
            )
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


# ----------------------------------------------------------------------------------- preemption

_sigterm = threading.Event()
_handler_installed = False


def _on_sigterm(signum: int, frame: Any) -> None:
    if _sigterm.is_set():  # a second SIGTERM: the trainer is not listening, so die as usual
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
    _sigterm.set()


def _on_sigusr1(signum: int, frame: Any) -> None:
    # SLURM's `--signal=USR1@T` warning. JAX's preemption notifier only listens for SIGTERM, so with
    # several processes pass it on as one; a single process treats it like a first SIGTERM.
    import jax

    if jax.process_count() > 1:
        os.kill(os.getpid(), signal.SIGTERM)
    else:
        _sigterm.set()


def preemption_requested(step: int) -> bool:
    """True at the call where every process should save a checkpoint and stop (SIGTERM or SIGUSR1).

    Call it with the same consecutive numbers in all processes (once per training step, and more
    often if the loop also checks inside the evaluation). With several processes it is JAX's
    preemption sync point (any process's signal, agreed call for all). A single process has no JAX
    preemption service; the first call installs a SIGTERM handler that sets a flag instead (a
    second SIGTERM still terminates), so the job scripts' TERM before the time limit checkpoints
    here too. SIGUSR1 is handled the same way in both cases.
    """
    global _handler_installed
    import jax

    if not _handler_installed and threading.current_thread() is threading.main_thread():
        if jax.process_count() == 1:  # with several, SIGTERM belongs to JAX's notifier
            signal.signal(signal.SIGTERM, _on_sigterm)
        signal.signal(signal.SIGUSR1, _on_sigusr1)
        _handler_installed = True
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        return multihost_utils.reached_preemption_sync_point(step)
    return _sigterm.is_set()
