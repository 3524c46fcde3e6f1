"""jaxrat.tune end to end on the toy smoke config: 6 trials, the tuner killed with -9 in the middle
of a trial and run again: the study ends with 6 counted trials, at least one pruned, and the trial
that was cut off retried in its own workdir, resuming from its checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest

from jaxrat.experiments import tune, tune_summary
from jaxrat.experiments.sweep import load_sweep
from runner import REPO, env_with_devices

pytestmark = [pytest.mark.slow, pytest.mark.integration]

TOY = "tests/toy/sweep_config.py"
ARGS = ["--trials", "6", "--metric", "eval/loss", "--mode", "min", "--config.train.eval_every=1",
        "--config.checkpoint.every_steps=1"]


def _tuner(root: str, log: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "jaxrat.tune", "--config", TOY, "--root", root, *ARGS], cwd=REPO,
                            env=env_with_devices(1), stdout=open(log, "w"), stderr=subprocess.STDOUT)


def _trials(root: str) -> list:
    try:
        return tune_summary.load_study(root).get_trials(deepcopy=False)
    except Exception:  # the journal is not there yet
        return []


def _running_in(workdir: str) -> bool:
    """Whether a process still trains in ``workdir`` (the killed tuner's child, stopping)."""
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and workdir.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                return True
        except OSError:
            continue
    return False


def test_kill9_of_the_tuner_then_rerun_completes_six_trials_with_a_pruned_one(tmp_path):
    root = str(tmp_path / "search")
    proc = _tuner(root, str(tmp_path / "first.log"))
    try:
        deadline = time.time() + 600
        victim = None
        while time.time() < deadline and proc.poll() is None:
            running = [t for t in _trials(root) if t.state == optuna.trial.TrialState.RUNNING and t.number >= 1]
            ckpts = [t for t in running if os.path.isdir(os.path.join(t.user_attrs.get("workdir", "/nonexistent"),
                                                                      "checkpoints", "1"))]
            if ckpts:
                victim = ckpts[0]
                break
            time.sleep(0.2)
        assert victim is not None, open(tmp_path / "first.log").read()[-3000:]
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    workdir = victim.user_attrs["workdir"]
    deadline = time.time() + 120
    while _running_in(workdir) and time.time() < deadline:  # its run got SIGTERM when the tuner died
        time.sleep(0.5)

    again = subprocess.run([sys.executable, "-m", "jaxrat.tune", "--config", TOY, "--root", root, *ARGS], cwd=REPO,
                           env=env_with_devices(1), capture_output=True, text=True, timeout=1200)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    trials = _trials(root)
    counted = tune.counted(tune_summary.load_study(root))
    assert len(counted) == 6 and all(t.state.is_finished() for t in trials)
    replaced = [t for t in trials if t.user_attrs.get("replaced")]
    assert [t.number for t in replaced] == [victim.number]
    retry = [t for t in trials if t.user_attrs.get("retry_of") == victim.number]
    assert len(retry) == 1 and retry[0].user_attrs["workdir"] == workdir and retry[0].params == victim.params
    assert "resumed from step" in open(os.path.join(workdir, "tune.log")).read()
    summary = json.load(open(os.path.join(root, "tune_summary.json")))
    assert summary["pruned"], summary["counts"]
    assert sum(summary["counts"].values()) == 6
    best = load_sweep(os.path.join(root, "best_sweep.py"))
    assert best[0].name == "best" and "--config.checkpoint.every_steps=1" in best[0].overrides
