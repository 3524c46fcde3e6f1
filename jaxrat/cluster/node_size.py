"""How much of a node a GPU job asks for, from ``sinfo``: the ``--cpus-per-task`` and ``--mem`` of
``jaxrat launch`` when the user does not give them."""

from __future__ import annotations

import re
import subprocess
import sys


def node_shape(partition: str | None) -> tuple[int, int, int] | None:
    """(CPUs, memory in MiB, GPUs) of the smallest node of ``partition`` (the default one when None),
    from ``sinfo``; None where sinfo is missing or fails (rendering away from the cluster)."""
    cmd = ["sinfo", "--noheader", "--format=%c %m %G"] + (["--partition", partition] if partition else [])
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    shapes = []
    for line in out.stdout.splitlines() if out.returncode == 0 else []:
        parts = line.split()
        if len(parts) < 2 or not parts[0].isdigit() or not parts[1].rstrip("+").isdigit():
            continue
        gpus = re.search(r"gpu(?::[\w-]+)?:(\d+)", parts[2] if len(parts) > 2 else "")
        shapes.append((int(parts[0]), int(parts[1].rstrip("+")), int(gpus.group(1)) if gpus else 0))
    return min(shapes) if shapes else None


def node_resources(cpus_per_task: int | None, mem: str | None, gpus_per_node: int, tasks_per_node: int,
                   partition: str | None) -> tuple[int | None, str | None]:
    """``--cpus-per-task`` and ``--mem`` as given, else, for a GPU job, from the node
    (:func:`node_shape`): the share of its CPUs and memory that the requested GPUs are of its GPUs,
    the CPUs split over the tasks, so each process gets decode workers. A CPU-only job, or an
    unknown node: as given (SLURM's defaults)."""
    if (cpus_per_task is not None and mem is not None) or not gpus_per_node:
        return cpus_per_task, mem
    shape = node_shape(partition)
    if shape is None:
        missing = " and ".join(f for f, v in (("--cpus-per-task", cpus_per_task), ("--mem", mem)) if v is None)
        print(f"jaxrat: could not size {missing} from the nodes (no sinfo here, or it failed), so SLURM's "
              f"defaults apply; pass {missing} to set them.", file=sys.stderr)
        return cpus_per_task, mem
    cpus, mem_mib, gpus = shape
    share = min(1.0, gpus_per_node / gpus) if gpus else 1.0
    if cpus_per_task is None:
        cpus_per_task = max(1, int(cpus * share) // max(tasks_per_node, 1))
    if mem is None:
        mem = "0" if share >= 1 else f"{int(mem_mib * share * 0.95)}M"  # 0: all of the node's memory
    return cpus_per_task, mem
