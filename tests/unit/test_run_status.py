"""A run's status in the same words in every table (summarize, report, tune), from its own record:
the lock, the checkpoints and summary.json."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

from jaxrat.experiments import summary
from jaxrat.experiments.report import machines
from jaxrat.experiments.status import run_status
from test_sweep import fake_checkpoint, fake_run


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _lock(workdir: Path, pid: int) -> None:
    (workdir / "run.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": pid, "token": "t"}))


def _summary(workdir: Path, **fields) -> None:
    (workdir / "summary.json").write_text(json.dumps(fields))


def test_every_status_word(tmp_path):
    assert run_status(str(tmp_path / "new"), 6) == "not started"
    done = tmp_path / "done"
    fake_checkpoint(done, 6)
    assert run_status(str(done), 6) == "finished"
    failed = tmp_path / "failed"
    fake_checkpoint(failed, 2)
    _summary(failed, status="failed", error="TrainingDiverged: the loss is NaN at step 3", steps={"last": 3})
    assert run_status(str(failed), 6) == "failed: TrainingDiverged: the loss is NaN at step 3"
    preempted = tmp_path / "preempted"
    fake_checkpoint(preempted, 4)
    _summary(preempted, status="preempted", steps={"last": 4})
    assert run_status(str(preempted), 6) == "preempted at step 4"
    interrupted = tmp_path / "interrupted"  # Ctrl-C: saved at a step, as for a preemption
    fake_checkpoint(interrupted, 3)
    _summary(interrupted, status="interrupted", steps={"last": 3})
    assert run_status(str(interrupted), 6) == "interrupted at step 3"
    killed = tmp_path / "killed"  # kill -9: the lock stays, its holder is gone; an old summary says otherwise
    fake_checkpoint(killed, 4)
    _summary(killed, status="preempted", steps={"last": 2})
    _lock(killed, _dead_pid())
    assert run_status(str(killed), 6) == "killed at step 4"
    running = tmp_path / "running"
    fake_checkpoint(running, 4)
    _lock(running, os.getpid())
    assert run_status(str(running), 6) == "running (step 4 saved)"


def test_summarize_and_report_say_the_same_from_the_runs_record(tmp_path):
    """summarize showed a failed run as "not started" (it ignored summary.json), the report said
    "failed"; a killed run was "running or not started" in the report."""
    root = tmp_path / "sweep"
    fake_run(root, "failed", [{"step": 1, "train/loss": 0.9}], done=False)
    _summary(root / "failed", status="failed", error="ValueError: bad batch", steps={"last": 1})
    fake_run(root, "killed", [{"step": 2, "eval/dice": 0.5}], done=False)
    _lock(root / "killed", _dead_pid())
    fake_run(root, "done", [{"step": 4, "eval/dice": 0.6}])
    states = {r.name: r.state for r in summary.collect(str(root))}
    assert states == {"done": "finished", "failed": "failed: ValueError: bad batch", "killed": "killed at step 2"}
    report = {r["run"]: r["status"] for r in machines({n: str(root / n) for n in states})}
    assert report == states


def test_a_run_preempted_in_its_final_eval_and_resumed_is_finished(tmp_path):
    """The resumed run redoes the final eval and ends without a newer checkpoint; its last one still
    says the eval is pending. The table said "stopped at step 4 of 4", and a sweep trained it again."""
    run = tmp_path / "run"
    fake_checkpoint(run, 4, eval_pending=True)
    _summary(run, status="preempted", steps={"first": 1, "last": 4})
    assert run_status(str(run), 4) == "preempted at step 4"
    _summary(run, status="finished", steps={"first": 4, "last": 4})
    assert run_status(str(run), 4) == "finished"

