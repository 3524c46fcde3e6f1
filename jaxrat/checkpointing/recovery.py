"""What to do when a checkpoint cannot be read back or written: agree, set aside, clean up, explain.

Checkpoints live on a filesystem that every process sees (Orbax's multi-process saves need one:
process 0 commits what all processes wrote). So one process, process 0, changes folders, and the
others wait for it at a barrier; whether a checkpoint is readable is decided by all processes
together, because each reads only the shards it needs and may be the only one to hit a bad file.
"""

from __future__ import annotations

import errno
import glob
import logging
import os
import shutil
import time

import jax
import numpy as np

from jaxrat.checkpointing import store

_DISK_FULL_TEXT = ("No space left on device", "Disk quota exceeded",
                   f"os_error_code='{errno.ENOSPC}'", f"os_error_code='{errno.EDQUOT}'")


def all_agree(ok: bool) -> bool:
    """True on every process when ``ok`` is true on every process (a collective)."""
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils

    return bool(np.all(multihost_utils.process_allgather(np.int32(ok))))


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def move_aside(directory: str, step: int) -> str:
    """Move ``<step>/`` to ``damaged/<step>-<UTC time>/`` (process 0; all processes return together).

    Returns the new path as process 0 chose it (on the others: the ``damaged/`` folder).
    """
    target = os.path.join(directory, store.DAMAGED_DIR)
    if jax.process_index() == 0:
        os.makedirs(target, exist_ok=True)
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        name, n = f"{step}-{stamp}", 1
        while os.path.exists(os.path.join(target, name)):
            name, n = f"{step}-{stamp}-{n}", n + 1
        target = os.path.join(target, name)
        os.rename(os.path.join(directory, str(step)), target)
    _barrier(f"jaxrat_checkpoint_aside_{step}")
    return target


def remove_uncommitted(directory: str, step: int) -> None:
    """Delete what a failed save of ``step`` left (process 0): its temporary folder, or a step folder
    without a commit marker. A committed ``<step>/`` is never touched."""
    if jax.process_index() != 0:
        return

    def leftovers() -> list[str]:
        found = glob.glob(os.path.join(glob.escape(directory), f"{step}.orbax-checkpoint-tmp*"))
        in_place = os.path.join(directory, str(step))
        if os.path.isdir(in_place) and not os.path.isfile(os.path.join(in_place, store.COMMIT_FILE)):
            found.append(in_place)
        return found

    # Orbax raises as soon as one of a save's writer threads fails; the others may still create
    # folders and files for a moment, so remove until the step's leftovers stay gone.
    deadline, quiet_since = time.monotonic() + 10.0, None
    while time.monotonic() < deadline:
        found = leftovers()
        for path in found:
            shutil.rmtree(path, ignore_errors=True)
            logging.info("checkpoint: removed %s, left by the failed save", path)
        now = time.monotonic()
        if found or quiet_since is None:
            quiet_since = now if not found else None
        elif now - quiet_since >= 0.5:
            return
        time.sleep(0.05)


def is_disk_full(error: BaseException) -> bool:
    """Whether ``error`` (or what caused it) says the disk or the quota is full.

    TensorStore reports it as a ValueError whose text carries the OS error, Python as an OSError.
    """
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(t in str(e) for t in _DISK_FULL_TEXT):
            return True
        e = e.__cause__ or e.__context__
    return False


def is_out_of_memory(error: BaseException) -> bool:
    """Device or host memory ran out while restoring: a property of this run, not of the files."""
    text = str(error).lower()
    return isinstance(error, MemoryError) or ("resource_exhausted" in text and "memory" in text)


def short_reason(error: BaseException) -> str:
    """The first line of an error, cut to a length that fits in a sentence."""
    first = (str(error).strip().splitlines() or [""])[0]
    first = first if len(first) <= 160 else first[:157] + "..."
    return f"{type(error).__name__}: {first}" if first else type(error).__name__
