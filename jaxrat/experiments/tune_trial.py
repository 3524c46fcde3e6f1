"""One trial of a search (:mod:`jaxrat.experiments.tune`): a ``jaxrat.main`` run as a subprocess,
followed through its ``metrics.jsonl``; every evaluation of the objective metric is reported to
the Optuna trial, and when the pruner says so the run gets SIGTERM (it checkpoints and stops, as
when preempted) and the trial is pruned.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import threading
import time
from typing import Any

from jaxrat.cluster import INTERRUPTED_EXIT_CODE, PREEMPTED_EXIT_CODE
from jaxrat.experiments.sweep import die_with_parent, wait_for_stopping_run


def _eval_rows(path: str, offset: int) -> tuple[list[dict[str, Any]], int]:
    """Complete lines of ``metrics.jsonl`` after ``offset``; returns them and the new offset."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except OSError:
        return [], offset
    end = data.rfind(b"\n") + 1
    rows = []
    for line in data[:end].splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows, offset + end


class Interrupted(Exception):
    """The worker was asked to stop (SIGTERM/SIGINT): its trial is queued again."""


# A trial's training process that ended like this was stopped from outside (its checkpoint is kept).
PREEMPTED_STATUSES = (PREEMPTED_EXIT_CODE, INTERRUPTED_EXIT_CODE, -signal.SIGTERM, -signal.SIGINT, -signal.SIGUSR1)


def run_trial(trial: Any, cmd: list[str], workdir: str, metric: str, env: dict[str, str] | None = None,
              stop: threading.Event | None = None) -> tuple[str, float | None]:
    """Train one trial; ("complete", value), ("pruned", last value) or ("failed", None).

    Raises :class:`Interrupted` when ``stop`` is set (the run was told to checkpoint and stop)."""
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, "metrics.jsonl")
    offset, last, pruned = 0, None, False
    with open(os.path.join(workdir, "tune.log"), "ab") as log:
        wait_for_stopping_run(workdir, f"tune: trial {trial.number}")  # a killed tuner's trial, still saving
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=die_with_parent)
        try:
            while True:
                done = proc.poll() is not None
                rows, offset = _eval_rows(path, offset)
                for row in rows:
                    # Once pruned, later rows are not the trial's: its value is the one it was pruned
                    # at. Neither that nor the decision may depend on how far the run got before this
                    # loop read its rows (a run that had ended was never pruned, and a pruned trial's
                    # value was whichever row came last), or a rerun's table differs from the first.
                    if not pruned and metric in row and isinstance(row.get("step"), int):
                        last = float(row[metric])
                        trial.report(last, row["step"])
                        if trial.should_prune():
                            pruned = True
                            logging.info("tune: trial %d pruned at step %d (%s %.4g)", trial.number, row["step"],
                                         metric, last)
                            if not done:
                                proc.send_signal(signal.SIGTERM)  # checkpoint and stop, as when preempted
                if done:
                    break
                if stop is not None and stop.is_set():
                    proc.send_signal(signal.SIGTERM)
                    proc.wait()
                    raise Interrupted()
                time.sleep(0.5)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    status = proc.returncode
    if pruned:
        return "pruned", last
    if status in PREEMPTED_STATUSES:
        # Preempted, not failed: scancel or a job's time limit sends SIGTERM to the worker and the
        # trial alike, and the trial can die of it (or save and exit 42) before the worker's own
        # handler has run. Seen on the local SLURM cluster: the trial was counted as failed.
        logging.info("tune: trial %d stopped with status %s (preempted); it resumes from its checkpoint",
                     trial.number, status)
        raise Interrupted()
    if status == 0 and last is not None:
        return "complete", last
    logging.warning("tune: trial %d ended with status %s%s; see %s", trial.number, status,
                    "" if last is not None else f" and no {metric}", os.path.join(workdir, "tune.log"))
    return "failed", None
