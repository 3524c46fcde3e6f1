"""``WORKDIR/run.lock``: one run per workdir, across processes and hosts (docs/workdir.md).

The lock file holds the holder's identity (:class:`Holder`); its mtime is a lease that the holder
refreshes from a daemon thread. A lock whose holder is provably gone is taken over with a warning.
A holder told to stop (SIGTERM: it checkpoints, then ends) says so in ``WORKDIR/run.lock.stopping``
(its token), so a sweep rerun waits for a stopping run as long as its heartbeat goes on, and does
not wait for one that is training.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Callable

from jaxrat.config_schema import default
from jaxrat.runtime import exit_guard
from jaxrat.runtime.errors import UserError
from jaxrat.runtime.fileio import write_bytes

LOCK_NAME = "run.lock"
DEFAULT_LEASE_S = default("workdir.lease_seconds")
STOPPING_SUFFIX = ".stopping"  # LOCK_NAME + this: the holder (its token) was told to stop and is stopping
STOPPING_POLL_S = 0.5  # how soon the heartbeat notices that the holder was told to stop


class WorkdirInUse(UserError):
    """Another live run holds the workdir."""


# ------------------------------------------------------------------------------------ the holder

def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks since boot) of ``pid`` from /proc, or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the command name may contain spaces and ")"
        return fields[0], int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


@dataclasses.dataclass
class Holder:
    """Who holds a workdir: enough to tell, from any host, whether that run still lives."""

    host: str
    pid: int
    since: float
    token: str
    start_ticks: int = -1  # the process's start time: a reused pid has another one
    boot_id: str = ""  # a rebooted host has another one
    pid_namespace: str = ""  # containers sharing a hostname and kernel do not see each other's pids
    slurm_job_id: str = ""
    slurm_restart_count: int = 0

    @classmethod
    def this_process(cls) -> Holder:
        stat = _proc_stat(os.getpid())
        return cls(host=socket.gethostname(), pid=os.getpid(), since=time.time(), token=uuid.uuid4().hex,
                   start_ticks=stat[1] if stat else -1, boot_id=_boot_id(), pid_namespace=_pid_namespace(),
                   slurm_job_id=os.environ.get("SLURM_JOB_ID", ""),
                   slurm_restart_count=int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0))

    def describe(self) -> str:
        job = f", SLURM job {self.slurm_job_id} restart {self.slurm_restart_count}" if self.slurm_job_id else ""
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.since))
        return f"process {self.pid} on host {self.host}{job}, since {since}"


def dead_reason(holder: Holder, age_s: float, lease_s: float, me: Holder) -> str | None:
    """Why ``holder`` (whose lock was last refreshed ``age_s`` ago) is certainly gone, or None."""
    same_pids = holder.boot_id == me.boot_id and holder.pid_namespace in ("", me.pid_namespace) and holder.pid > 0
    if holder.host == me.host and same_pids:
        try:
            os.kill(holder.pid, 0)
        except ProcessLookupError:
            return "its process is gone"
        except PermissionError:
            pass  # another user's live process
        stat = _proc_stat(holder.pid)
        if stat and stat[0] in "ZX":
            return "its process has exited"
        if stat and holder.start_ticks >= 0 and stat[1] != holder.start_ticks:
            return "its process is gone (the process id now belongs to another process)"
        return None
    if holder.host == me.host and holder.boot_id and me.boot_id and holder.boot_id != me.boot_id:
        return "its host has rebooted since"
    if age_s > lease_s:
        return f"its lease expired (no heartbeat for {age_s:.0f} s, lease {lease_s:.0f} s)"
    return None


def _previous_incarnation(holder: Holder, me: Holder) -> bool:
    """An earlier start of this same SLURM job (a requeue) running elsewhere."""
    return bool(me.slurm_job_id) and holder.slurm_job_id == me.slurm_job_id and \
        holder.slurm_restart_count < me.slurm_restart_count and holder.host != me.host


def _read_holder(path: str) -> tuple[Holder | None, float] | None:
    """(the Holder in ``path``, or None if unreadable; its mtime), or None if there is no file."""
    try:
        with open(path, "rb") as f:  # open, then fstat: fresh attributes on NFS (close-to-open)
            mtime = os.fstat(f.fileno()).st_mtime
            raw = f.read()
    except FileNotFoundError:
        return None
    try:
        fields = json.loads(raw)
        return Holder(**{k: fields[k] for k in fields if k in Holder.__dataclass_fields__}), mtime
    except (ValueError, TypeError):
        return None, mtime


# -------------------------------------------------------------------------------------- the lock

class WorkdirLock:
    """``WORKDIR/run.lock``: a JSON :class:`Holder`, created atomically, whose mtime is a lease.

    The holder refreshes the lease (the file's mtime) every ``lease_s / 4`` from a daemon thread.
    A lock is taken over when :func:`dead_reason` proves its holder gone: by process id and start
    time on the same host, by an expired lease from another host.
    """

    lock_name = LOCK_NAME
    what = "workdir"  # the folder as the refusal names it
    user = "run"  # who holds it
    instead = "use another --workdir"  # the way around a live holder

    def __init__(self, workdir: str, lease_s: float = DEFAULT_LEASE_S,
                 stopping: Callable[[], bool] | None = None) -> None:
        """``stopping``: whether this process was told to stop (e.g. :func:`jaxrat.cluster.preemption.signalled`);
        once it says so, the heartbeat writes ``LOCK.stopping`` with this holder's token."""
        self.path = os.path.join(workdir, self.lock_name)
        self.stopping_path = self.path + STOPPING_SUFFIX
        self._stopping = stopping
        self.lease_s = float(lease_s)
        self.me = Holder.this_process()
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        self.held = False

    def acquire(self) -> None:
        """Take the lock, or raise :class:`WorkdirInUse` naming the live holder and the fix."""
        for attempt in range(10):
            time.sleep(0.05 * attempt)  # a retry follows another starter's takeover: let it finish
            with exit_guard.whole():  # a quick exit finds the lock either held (and releases it) or not taken
                created = self._create()
                if created:
                    self._start_heartbeat()
            if created:
                return
            found = self._read()
            if found is None:  # released (or taken over) while we looked: try again
                continue
            holder, age = found[0], time.time() - found[1]
            reason = self._wait_for_death(holder, age) if holder else (
                f"its lock file is unreadable and {age:.0f} s old" if age > self.lease_s else None)
            if reason is None:
                raise WorkdirInUse(self._in_use_message(holder, age))
            with exit_guard.whole():
                taken = self._take_over(holder)
                if taken:
                    self._start_heartbeat()
            if taken:
                logging.warning("took over the workdir lock %s of %s: %s", self.path,
                                holder.describe() if holder else "an unknown run", reason)
                return
        raise WorkdirInUse(f"The {self.what} lock {self.path} keeps changing hands; another {self.user} is starting "
                           f"on this {self.what} at the same time: wait for it or {self.instead}.")

    def release(self) -> None:
        """Stop the heartbeat and remove the lock if it is still ours."""
        self._stop.set()
        if self._beat is not None:
            self._beat.join(timeout=5)
        if self.held and self._owner_token() == self.me.token:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.stopping_path)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        self.held = False

    # ---- internals

    def _payload(self) -> bytes:
        return json.dumps(dataclasses.asdict(self.me), sort_keys=True).encode()

    def _write_tmp(self) -> str:
        tmp = f"{self.path}.{self.me.token}.tmp"  # named for its owner: a dead one's is recognisable
        try:
            with open(tmp, "wb") as f:
                f.write(self._payload())
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return tmp

    def _create(self) -> bool:
        """Atomically create the lock if there is none: a hard link of a complete file, which fails
        when the name exists (NFS too; there a lost reply is told apart by the link count)."""
        tmp = self._write_tmp()
        try:
            try:
                os.link(tmp, self.path)
            except FileExistsError:
                return False
            except OSError as e:
                if e.errno in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
                    return self._create_exclusive()  # no hard links on this filesystem
                if os.stat(tmp).st_nlink != 2:
                    raise
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        return self._owner_token() == self.me.token

    def _create_exclusive(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(self._payload())
        return True

    def _read(self) -> tuple[Holder | None, float] | None:
        """(holder or None if unreadable, time of its last heartbeat), or None if there is no lock."""
        return _read_holder(self.path)

    def _owner_token(self) -> str | None:
        found = self._read()
        return found[0].token if found and found[0] else None

    def _wait_for_death(self, holder: Holder, age: float) -> str | None:
        """:func:`dead_reason`; for an earlier start of this SLURM job on another host, whose
        allocation may still be winding down, wait up to a lease for its heartbeat to stop."""
        reason = dead_reason(holder, age, self.lease_s, self.me)
        if reason is not None or not _previous_incarnation(holder, self.me):
            return reason
        logging.warning("the workdir lock is held by %s, an earlier start of this job; waiting up to %.0f s for "
                        "its heartbeat to stop", holder.describe(), self.lease_s - age)
        first = self._read()
        deadline = time.monotonic() + self.lease_s - age + 2
        while first is not None and time.monotonic() < deadline:
            time.sleep(1.0)
            found = self._read()
            if found is None or found[0] is None or found[0].token != holder.token:
                return "it released the lock"
            if found[1] != first[1]:
                return None  # a new heartbeat: that allocation still runs
            reason = dead_reason(holder, time.time() - found[1], self.lease_s, self.me)
            if reason:
                return reason
        return dead_reason(holder, time.time() - first[1], self.lease_s, self.me) if first else "it released the lock"

    def _take_over(self, stale: Holder | None) -> bool:
        """Replace the lock of a dead holder. A marker file made with O_EXCL, named after the dead
        holder and naming its taker, lets only one of several runs starting together replace it."""
        marker = f"{self.path}.takeover-{stale.token if stale else 'unreadable'}"
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            self._clear_dead_marker(marker)
            return False
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(self._payload())
            now = self._read()
            if now is None or (now[0].token if now[0] else None) != (stale.token if stale else None):
                return False  # it changed under us: decide again
            write_bytes(self.path, self._payload())
            return self._owner_token() == self.me.token
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(marker)

    def _clear_dead_marker(self, marker: str) -> None:
        """Remove a takeover marker whose taker died before finishing (kill -9 in that instant),
        else it would block every later start. Moved aside first and checked, so a live taker's
        marker that replaced it meanwhile is put back, never deleted."""
        found = _read_holder(marker)
        if found is None:
            return
        taker, mtime = found
        age, grace = time.time() - mtime, min(30.0, self.lease_s)
        if (dead_reason(taker, age, grace, self.me) if taker else ("unreadable" if age > grace else None)) is None:
            return
        grave = f"{marker}.dead-{self.me.token}"
        try:
            os.rename(marker, grave)
        except FileNotFoundError:
            return
        moved = _read_holder(grave)
        if moved is not None and moved[0] is not None and taker is not None and moved[0].token != taker.token:
            with contextlib.suppress(FileExistsError):
                os.link(grave, marker)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(grave)

    def _start_heartbeat(self) -> None:
        self.held = True
        self._stop.clear()
        self._beat = threading.Thread(target=self._heartbeat, name="workdir-lock-heartbeat", daemon=True)
        self._beat.start()

    def _heartbeat(self) -> None:
        # utime, not a rewrite: a holder that wakes after a takeover can only refresh the new
        # holder's lease, never overwrite its identity.
        beat = self.lease_s / 4
        poll = min(beat, STOPPING_POLL_S) if self._stopping is not None else beat
        marked, last = False, time.monotonic()
        while not self._stop.wait(poll):
            if not marked and self._stopping is not None and self._stopping():
                marked = self._mark_stopping()
            if time.monotonic() - last < beat - poll / 2:  # a lease refresh every `beat`
                continue
            last = time.monotonic()
            try:
                if self._owner_token() != self.me.token:
                    logging.error("the workdir lock %s is no longer held by this run (another run took it over "
                                  "after this run's lease expired); two runs may now write to this workdir",
                                  self.path)
                    return
                os.utime(self.path)
            except OSError as e:  # a storage hiccup: the next beat tries again
                logging.warning("could not refresh the workdir lock %s: %s", self.path, e)

    def _mark_stopping(self) -> bool:
        """Write ``LOCK.stopping`` (this holder's token and when) while the lock is still ours."""
        try:
            if self._owner_token() == self.me.token:
                write_bytes(self.stopping_path, json.dumps({"token": self.me.token, "since": time.time()}).encode())
                return True
        except OSError as e:  # a storage hiccup: a later poll tries again
            logging.warning("could not mark the workdir lock %s as stopping: %s", self.path, e)
        return False

    def _in_use_message(self, holder: Holder | None, age: float) -> str:
        if holder is None:
            return (f"The {self.what} {os.path.dirname(self.path)} is locked by a {self.user} whose lock file "
                    f"{self.path} is unreadable (refreshed {age:.0f} s ago); wait {self.lease_s - age:.0f} s for its "
                    f"lease to expire, or {self.instead}.")
        stop = f"scancel {holder.slurm_job_id}" if holder.slurm_job_id else f"kill {holder.pid} on {holder.host}"
        if _previous_incarnation(holder, self.me):  # scancel would end this start too
            stop = f"kill {holder.pid} on {holder.host}: an earlier start of this job still runs there"
        return (f"The {self.what} {os.path.dirname(self.path)} is in use by another {self.user} ({holder.describe()}, "
                f"last heartbeat {max(age, 0):.0f} s ago): wait for it to end, stop it ({stop}), or {self.instead}.")


OUTPUT_LOCK_NAME = ".jaxrat-output.lock"


class OutputFolderLock(WorkdirLock):
    """``OUT/.jaxrat-output.lock``: one predict or evaluate writing into a folder at a time, held and
    taken over exactly as the workdir lock is; the second writer is refused naming the first."""

    lock_name = OUTPUT_LOCK_NAME
    what = "output folder"
    user = "command"
    instead = "pass another --out"

    def __init__(self, folder: str, instead: str = "") -> None:
        """``instead``: the way around a live holder when it is not another --out (evaluate's own
        folder under WORKDIR/eval is named by --name)."""
        super().__init__(folder)
        self.instead = instead or self.instead
