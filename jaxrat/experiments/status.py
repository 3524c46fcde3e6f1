"""One run's status in words, from its own record, the same in every table (summarize, report, tune).

The record: ``run.lock`` (a live holder: running; a holder that is gone: the process died without
ending the run, e.g. kill -9, out of memory, a lost node), the newest committed checkpoint against
the steps asked for (finished, or stopped early), and ``summary.json``, which a run writes as it
ends (failed, with its reason; preempted). Everything here only reads.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from typing import Any

from jaxrat.checkpointing.store import committed_steps, step_metadata, stopped_early
from jaxrat.config_schema import default
from jaxrat.runtime.fileio import read_json

LOCK = "run.lock"  # jaxrat.trainer.workdir_lock.LOCK_NAME (a layer this one does not import)
LEASE_S = default("workdir.lease_seconds")  # a holder elsewhere silent this long is gone
STOPPING = LOCK + ".stopping"  # jaxrat.trainer.workdir_lock.STOPPING_SUFFIX: its holder was told to stop


@dataclasses.dataclass(frozen=True)
class RunState:
    """How far a variant's workdir got: its newest committed checkpoint against the steps asked for."""

    step: int | None
    total: int
    eval_pending: bool = False
    stopped_early: bool = False

    @property
    def finished(self) -> bool:
        """The final step is checkpointed and its evaluation done (a run preempted in the final
        evaluation saved the final step with the eval still pending), or early stopping ended it."""
        if self.step is not None and self.stopped_early:
            return True
        return self.step is not None and self.step >= self.total and not self.eval_pending

    def describe(self) -> str:
        if self.finished:
            return f"stopped early at step {self.step}" if self.stopped_early else "finished"
        if self.step is None:
            return "not started"
        return f"at step {self.step} of {self.total}"


def run_state(workdir: str, total: int) -> RunState:
    """The :class:`RunState` of ``workdir`` for a run of ``total`` steps (read-only)."""
    directory = os.path.join(workdir, "checkpoints")
    steps = committed_steps(directory)
    if not steps:
        return RunState(None, total)
    meta = step_metadata(directory, steps[-1])
    # A run preempted in its final evaluation saves that step with the eval pending; the resumed
    # run does the eval and ends without a newer checkpoint, so only its summary says it is done.
    pending = bool(meta.get("eval_pending")) and not _summary_says_finished(workdir, steps[-1])
    return RunState(steps[-1], total, pending, stopped_early(meta) or _summary_says_stopped(workdir, steps[-1]))


def _read_json(path: str) -> dict[str, Any]:
    data = read_json(path)
    return data if isinstance(data, dict) else {}


def _summary_says_finished(workdir: str, step: int) -> bool:
    summary = _read_json(os.path.join(workdir, "summary.json"))
    return summary.get("status") == "finished" and (summary.get("steps") or {}).get("last") == step


def _summary_says_stopped(workdir: str, step: int) -> bool:
    """Early stopping at a step saved before (a resumed run that redid that step's evaluation and
    stopped there) is recorded in ``summary.json`` only."""
    return (_read_json(os.path.join(workdir, "summary.json")).get("stopped_early") or {}).get("step") == step


def _pid_lives(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in "ZX"  # exited, not yet reaped
    except ProcessLookupError:
        return False
    except (PermissionError, OSError, IndexError):
        return True


def lock_holder(workdir: str) -> tuple[bool, int] | None:
    """(alive, pid) of the run holding ``WORKDIR/run.lock``, or None when there is no lock. A holder
    on another host is alive while its lease is fresh."""
    path = os.path.join(workdir, LOCK)
    holder = _read_json(path)
    if not holder:
        return None if not os.path.exists(path) else (False, -1)
    try:
        pid = int(holder.get("pid", -1))
        age = time.time() - os.path.getmtime(path)
    except (OSError, TypeError, ValueError):
        return None
    if holder.get("host") == socket.gethostname() and pid > 0:
        return _pid_lives(pid), pid
    return age < LEASE_S, pid


def live_local_holder(workdir: str) -> int | None:
    """The process id in ``WORKDIR/run.lock`` if that process lives on this host, else None."""
    found = lock_holder(workdir)
    holder = _read_json(os.path.join(workdir, LOCK))
    if found and found[0] and holder.get("host") == socket.gethostname():
        return found[1]
    return None


def holder_stopping(workdir: str) -> bool:
    """Whether the run holding ``WORKDIR/run.lock`` said it was told to stop and is stopping (its
    token in ``run.lock.stopping``); a run that is training says nothing."""
    token = _read_json(os.path.join(workdir, LOCK)).get("token")
    return bool(token) and _read_json(os.path.join(workdir, STOPPING)).get("token") == token


def heartbeat_age(workdir: str) -> float | None:
    """Seconds since the holder of ``WORKDIR/run.lock`` last refreshed it, or None without a lock."""
    try:
        return time.time() - os.path.getmtime(os.path.join(workdir, LOCK))
    except OSError:
        return None


def run_status(workdir: str, total: int | None) -> str:
    """The run's status in words: "running", "finished", "stopped early at step N", "failed: REASON",
    "preempted at step N", "interrupted at step N" (Ctrl-C), "killed at step N", "stopped at step N of T", or
    "not started"."""
    held = lock_holder(workdir)
    state = run_state(workdir, total) if total is not None else None
    step = state.step if state else None
    if held and held[0]:
        return "running" + (f" (step {step} saved)" if step is not None else "")
    if state and state.finished:
        return state.describe()
    summary = _read_json(os.path.join(workdir, "summary.json"))
    where = step if step is not None else (summary.get("steps") or {}).get("last")
    at = f" at step {where}" if where is not None else " before its first checkpoint"
    if held:  # a lock whose holder is gone: the process died without ending the run
        return "killed" + at
    status = summary.get("status")
    if status == "failed":
        return "failed: " + (summary.get("error") or "see its log")
    if status in ("preempted", "interrupted"):
        return status + at
    if status == "finished" and state is None:
        return "finished"
    if step is None and not os.path.exists(os.path.join(workdir, "metrics.jsonl")):
        return "not started"
    return f"stopped{at}" + (f" of {total}" if total is not None and where is not None else "")
