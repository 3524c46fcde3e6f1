"""What happens to a bad dataset file: ``fail`` (default) or ``skip``.

Why skipping never drops elements from the stream: every host must run the same number of
steps, and the global batch of step ``s`` must stay a pure function of (seed, s). So a bad file
is handled in two deterministic places, identically on every host:

1. Before the stream is built, every (image, annotation) pair is checked from file headers
   only (missing mask, empty file, not an image, mask size differing from its image). Bad pairs
   are removed from the record list; every host sees the same files, so every host gets the same
   list, and the stream is built over it as usual.
2. A file that passes the header check but fails to decode (a truncated JPEG, corrupt PNG data)
   is found only when read. The element is then *replaced by the next element of the shuffled
   stream* (global index ``i`` -> ``i+1`` -> ...), which depends only on (seed, i) and the
   files, never on the host, the worker count or timing. Eval marks such an element invalid.

Under ``fail`` both places raise :class:`~jaxrat.runtime.errors.DataError` naming the file and the
problem; the header checks of a dataset (inside :func:`refuse_once`) go through every file first
and then refuse once, listing every bad file found (the first :data:`LISTED`, then their count),
so a user fixes them all in one rerun. Under ``skip`` each bad file is logged with a running count
and appended (once) to ``WORKDIR/skipped_files.txt`` by process 0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import logging
import os
import threading
from typing import Callable, Iterator, TypeVar

from jaxrat.data.imageio import BadFileError
from jaxrat.runtime.errors import ConfigError, DataError

POLICIES = ("fail", "skip")
SKIPPED_FILES_NAME = "skipped_files.txt"

_lock = threading.Lock()
_seen: set[str] = set()
# Bad files found by header checks under "fail" while a scan (refuse_once) is open on this thread.
_scan = threading.local()
# Bad files named in one refusal; the rest are counted.
LISTED = 20
_F = TypeVar("_F", bound=Callable)


@dataclasses.dataclass(frozen=True)
class BadFilePolicy:
    """Picklable (it travels to worker processes). ``record_path`` is None on processes > 0."""

    mode: str = "fail"
    record_path: str | None = None

    def __post_init__(self):
        if self.mode not in POLICIES:
            raise ConfigError(f"config.data.on_bad_file={self.mode!r}; use 'fail' or 'skip'.")

    @property
    def skip(self) -> bool:
        return self.mode == "skip"

    def handle(self, error: BadFileError) -> None:
        """Raise ``error`` under ``fail``; under ``skip`` log and record it, then return."""
        if not self.skip:
            found = getattr(_scan, "found", None)
            if found is None:
                raise error
            found.append(error)  # the caller leaves the file out; the scan refuses at its end
            return
        with _lock:
            new = error.path not in _seen
            _seen.add(error.path)
            count = len(_seen)
        if not new:
            return  # the same file comes back every epoch: log and record it once
        if self.record_path:
            # The list is shared with the worker processes, each of which counts only its own finds.
            count = _append_once(self.record_path, f"{error.path}\t{error.problem}")
        logging.warning("skipping bad file %s (%s); %d skipped so far", error.path, error.problem, count)


@contextlib.contextmanager
def scanning() -> Iterator[None]:
    """Header checks inside are collected under ``fail`` and refused once at the end, listing every
    bad file (see :func:`refusal`). Nested scans join the outer one."""
    if getattr(_scan, "found", None) is not None:
        yield
        return
    _scan.found = []
    try:
        yield
    except DataError:
        # A consequence of the files left out ("every pair is bad", "no pairs"): the list says why.
        if not _scan.found:
            raise
    finally:
        found, _scan.found = _scan.found, None
    if found:
        raise refusal(found) from None


def refuse_once(fn: _F) -> _F:
    """Decorator: ``fn`` (a dataset's resolution) runs inside :func:`scanning`."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with scanning():
            return fn(*args, **kwargs)
    return wrapped  # type: ignore[return-value]


def refusal(found: list[BadFileError]) -> DataError:
    """One error for the bad files of a scan: the file's own message for one; for several, each
    file and its problem (the first :data:`LISTED`, then how many more) and one fix."""
    unique = list({e.path: e for e in found}.values())
    if len(unique) == 1:
        return unique[0]
    lines = [f"  {e.path}: {e.problem}" for e in unique[:LISTED]]
    if len(unique) > LISTED:
        lines.append(f"  ... and {len(unique) - LISTED} more")
    return DataError(f"{len(unique)} bad files in the dataset; fix or remove each of them, or set "
                     f"--config.data.on_bad_file=skip to leave them out:\n" + "\n".join(lines))


def _append_once(path: str, line: str) -> int:
    """Append ``line`` unless present; safe across worker processes (flock). Returns the line count."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            f.seek(0)
            lines = f.read().splitlines()
            if line not in lines:
                f.write(line + "\n")
                f.flush()
                lines.append(line)
            return len(lines)
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def read_skipped(path: str) -> list[tuple[str, str]]:
    """(file, problem) rows of a ``skipped_files.txt``; empty if there is none."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [tuple(line.rstrip("\n").split("\t", 1)) for line in f if line.strip()]  # type: ignore[misc]
