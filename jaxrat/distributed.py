"""Multi-process initialisation (minimal; launcher detection grows here).

``initialize`` must run before any other JAX use. With no launcher in the environment it
does nothing and JAX runs as a single process.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import jax


@dataclasses.dataclass(frozen=True)
class WorldInfo:
    """What this process learnt about the job it belongs to."""

    launcher: str
    process_index: int
    process_count: int
    coordinator: str | None


def initialize(dist_config: Any = None) -> WorldInfo:
    """Initialise ``jax.distributed`` from the config or the environment (SLURM only for now)."""
    cfg = dict(dist_config or {})
    explicit = cfg.get("coordinator_address")
    if explicit:
        jax.distributed.initialize(
            coordinator_address=explicit,
            num_processes=cfg.get("num_processes"),
            process_id=cfg.get("process_id"),
        )
        launcher = "explicit"
    elif "SLURM_JOB_ID" in os.environ and "SLURM_STEP_NODELIST" in os.environ:
        jax.distributed.initialize()
        launcher = "slurm"
    else:
        launcher = "single"
    info = WorldInfo(launcher, jax.process_index(), jax.process_count(), explicit)
    logging.info(
        "launcher=%s process %d/%d local_devices=%d global_devices=%d",
        info.launcher, info.process_index, info.process_count,
        jax.local_device_count(), jax.device_count(),
    )
    return info
