"""``metrics.jsonl``: one JSON line ``{"step": S, "time": T, name: value, ...}`` per logged group."""

from __future__ import annotations

import json
import os
import time
from typing import Mapping

from jaxrat.tracking.base import TrackerBase


class JsonlTracker(TrackerBase):
    """Appends to ``WORKDIR/metrics.jsonl``; a line is written whole or not at all (disk full midway)."""

    name = "metrics.jsonl"

    def __init__(self, workdir: str) -> None:
        self.path = os.path.join(workdir, "metrics.jsonl")
        self.name = self.path
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def _append_line(self, line: str) -> None:
        """One ``write`` per line; a partial one (disk full midway) is cut back off."""
        data = line.encode()
        start = os.lseek(self._fd, 0, os.SEEK_END)
        written = os.write(self._fd, data)
        if written < len(data):
            os.ftruncate(self._fd, start)
            raise OSError(28, "No space left on device")

    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        self._append_line(json.dumps({"step": int(step), "time": time.time(), **scalars}) + "\n")

    def close(self, status: str = "finished") -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
