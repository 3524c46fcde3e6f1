"""Where a synthetic dataset lives.

A training run writes it under its workdir, one copy per process on that process's disk
(``WORKDIR/synthetic_data/process_<i>``). A command that only reads a trained run (``jaxrat
evaluate``, ``jaxrat robustness``, a :class:`~jaxrat.inference.predictor.Predictor` re-reading label
names) prepares its data in its own folder; inside :func:`reading_run` it reads the run's own copy
instead when that holds exactly the dataset its config asks for (the marker's parameters equal),
and never writes there: a copy per evaluation folder cost the whole dataset's size each time.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from typing import Iterator, Sequence

from jaxrat.runtime.fileio import read_json

# The trained run whose synthetic data may be read ("" while a training run prepares its own). A
# context variable rather than an argument: a task's prepare_data(workdir) is a public interface
# (custom tasks implement it) and says nothing of a second folder.
_RUN = contextvars.ContextVar("jaxrat_synthetic_run", default="")


def folder(workdir: str, process_index: int) -> str:
    """``WORKDIR/synthetic_data/process_<i>``, where ``workdir``'s process ``i`` writes its copy."""
    # One copy per process on its own disk: correct whether or not the workdir is shared.
    return os.path.join(workdir, "synthetic_data", f"process_{process_index}")


@contextlib.contextmanager
def reading_run(workdir: str) -> Iterator[None]:
    """Let the synthetic writers called inside find the data of the trained run in ``workdir``."""
    token = _RUN.set(workdir)
    try:
        yield
    finally:
        _RUN.reset(token)


def run_copies(process_index: int) -> list[str]:
    """The trained run's folders that may hold this process's data (its own process's, then process
    0's, which a shared disk holds for every process); none outside :func:`reading_run`."""
    run = _RUN.get()
    return [folder(run, i) for i in dict.fromkeys((process_index, 0))] if run else []


def written(folders: Sequence[str], marker: str, params: dict) -> str:
    """The first of ``folders`` that holds the whole dataset of ``params`` (its ``marker`` file, written
    last, records them), or ""."""
    return next((path for path in folders if read_json(os.path.join(path, marker)) == params), "")
