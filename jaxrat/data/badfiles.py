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
problem. Under ``skip`` each bad file is logged with a running count and appended (once) to
``WORKDIR/skipped_files.txt`` by process 0.
"""

from __future__ import annotations

import dataclasses
import fcntl
import logging
import os
import threading

from jaxrat.data.imageio import BadFileError
from jaxrat.runtime.errors import ConfigError

POLICIES = ("fail", "skip")
SKIPPED_FILES_NAME = "skipped_files.txt"

_lock = threading.Lock()
_seen: set[str] = set()


def skipped_count() -> int:
    """Distinct bad files skipped so far by this process (workers count their own)."""
    return len(_seen)


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
            raise error
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
