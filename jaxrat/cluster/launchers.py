"""What each launcher's environment says about this process: SLURM, Open MPI, torchrun, LSF.

Pure functions of an environment mapping (no JAX, no network), so every launcher is unit-tested
with synthetic environments. :mod:`jaxrat.cluster.detect` picks the launcher and applies the
config's overrides on top of what is read here.
"""

from __future__ import annotations

import dataclasses
import re
import zlib
from collections.abc import Callable, Mapping

from jaxrat.runtime.errors import UserError

# jax picks coordinator ports in [61440, 65535], above Linux's ephemeral range; so do we.
_PORT_BASE, _PORT_SPAN = 61440, 4096


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """Who this process is in its job: the arguments for ``jax.distributed.initialize``."""

    launcher: str
    num_processes: int
    process_id: int
    coordinator_address: str | None = None
    # Device ordinals (within CUDA_VISIBLE_DEVICES) this process drives; None means all visible.
    local_device_ids: tuple[int, ...] | None = None


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


NO_COORDINATOR = {"mpi": "Open MPI 5 does not publish the address of rank 0 when the ranks span several hosts"}


def _is_torchrun(env: Mapping[str, str]) -> bool:
    return any(k in env for k in ("TORCHELASTIC_RUN_ID", "WORLD_SIZE")) or ("RANK" in env and "MASTER_ADDR" in env)


# Innermost launcher first: torchrun or mpirun may run inside a SLURM or LSF job.
_LAUNCHERS: dict[str, tuple[Callable[[Mapping[str, str]], bool], Callable[[_Env], ClusterSpec]]] = {
    "torchrun": (_is_torchrun, _detect_torchrun),
    "mpi": (lambda env: "OMPI_COMM_WORLD_SIZE" in env or "OMPI_MCA_orte_hnp_uri" in env, _detect_mpi),
    "slurm": (lambda env: "SLURM_JOB_ID" in env, _detect_slurm),
    "lsf": (lambda env: "LSB_JOBID" in env, _detect_lsf),
}
KNOWN = tuple(_LAUNCHERS)


def find_launcher(env: Mapping[str, str]) -> str | None:
    """The innermost launcher whose variables are in ``env`` (one of :data:`KNOWN`), or None."""
    return next((name for name, (present, _) in _LAUNCHERS.items() if present(env)), None)


def read_launcher(name: str, env: Mapping[str, str]) -> ClusterSpec:
    """What launcher ``name``'s variables in ``env`` say; a UserError names a missing or contradictory one."""
    return _LAUNCHERS[name][1](_Env(env, name))
