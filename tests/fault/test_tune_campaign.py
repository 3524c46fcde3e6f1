"""A bounded fault campaign for jaxrat.tune: a search killed with -9 at random points, then run
again, ends with the undisturbed search's table (exactly: the trainings resume bit for bit, the
sampler is seeded per trial and pruning does not depend on timing); two workers on one study,
killed at random points, run exactly ``--trials`` trials, each scored as its parameters score
undisturbed, and name the true best. The sweep's campaign is tests/fault/test_fault_campaign.py.

The points are drawn from ``JAXRAT_FAULT_SEED`` (default 0), so a failure can be replayed.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time

import pytest

from jaxrat.experiments import tune, tune_summary
from jaxrat.experiments.sweep import train_command
from runner import REPO, env_with_devices, read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.integration]

TOY = os.path.join(REPO, "tests", "toy", "sweep_config.py")  # configs/isic.py:smoke, 4 steps
METRIC = "eval/loss"
COMMON = ["--config.train.eval_every=1", "--config.checkpoint.every_steps=1"]
ARGS = ["--trials", "4", "--metric", METRIC, "--mode", "min", *COMMON]


def _cmd(root: str) -> list[str]:
    return [sys.executable, "-m", "jaxrat.tune", "--config", TOY, "--root", root, *ARGS]


def _start(root: str, log: str) -> subprocess.Popen:
    return subprocess.Popen(_cmd(root), cwd=REPO, env=env_with_devices(1), stdout=open(log, "a"),
                            stderr=subprocess.STDOUT)


def _finish(root: str) -> dict:
    """Run the tuner to the end (it resumes whatever is left) and return its summary."""
    done = subprocess.run(_cmd(root), cwd=REPO, env=env_with_devices(1), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with open(os.path.join(root, "tune_summary.json")) as f:
        return json.load(f)


def _key(params: dict) -> tuple:
    return tuple(sorted(params.items()))


def _counted(summary: dict) -> list[dict]:
    return [r for r in summary["trials"] if not r["replaced"]]


def _table(summary: dict) -> list[tuple]:
    """What an undisturbed search decides, trial by trial; a pruned run's own status depends on how
    far it got before its SIGTERM, so only a complete trial's is compared."""
    return [(r["state"], r["value"], r["last_step"], r["last_reported"], _key(r["params"]),
             r["run"] if r["state"] == "complete" else None) for r in _counted(summary)]


def _newest(root: str) -> int:
    """The newest trial's number in the study of ``root``, -1 before the first."""
    try:
        return max((t.number for t in tune_summary.load_study(root).get_trials(deepcopy=False)), default=-1)
    except Exception:  # no journal yet
        return -1


def _wait_for_trial(root: str, number: int, proc: subprocess.Popen) -> None:
    """Until trial ``number`` has been asked for (or ``proc`` has ended: nothing is left to kill)."""
    deadline = time.monotonic() + 600
    while proc.poll() is None and _newest(root) < number and time.monotonic() < deadline:
        time.sleep(0.2)


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory) -> dict:
    """The summary of the search run once without a fault."""
    return _finish(str(tmp_path_factory.mktemp("tune") / "undisturbed"))


def _sane(summary: dict, root: str) -> None:
    """Exactly --trials trials, each complete or pruned, none left running or queued, the best the best."""
    rows = _counted(summary)
    assert len(rows) == 4 and {r["state"] for r in rows} <= {"complete", "pruned"}, summary["counts"]
    assert all(r["state"] == "fail" for r in summary["trials"] if r["replaced"])
    complete = [r for r in rows if r["state"] == "complete"]
    assert summary["best"]["value"] == min(r["value"] for r in complete)
    assert len(tune.counted(tune_summary.load_study(root))) == 4


def test_a_search_killed_at_random_points_ends_with_the_undisturbed_table(undisturbed, tmp_path):
    rng = random.Random(int(os.environ.get("JAXRAT_FAULT_SEED", "0")))
    ref = undisturbed
    root, log = str(tmp_path / "killed"), str(tmp_path / "killed.log")
    for _ in range(2):  # kill -9 twice (its trainings get SIGTERM from the kernel), each in one of the
        proc = _start(root, log)  # first three trials left, where the trials after it must draw the same
        _wait_for_trial(root, _newest(root) + 1 + rng.randrange(3), proc)
        time.sleep(rng.uniform(0.0, 10.0))
        proc.kill()
        proc.wait(30)
    summary = _finish(root)
    _sane(summary, root)
    assert any(r["replaced"] for r in summary["trials"]), "no kill cut a trial short"
    assert _table(summary) == _table(ref), open(log).read()[-3000:]
    assert (summary["best"]["value"], summary["best"]["params"]) == (ref["best"]["value"], ref["best"]["params"])


def _curve(workdir: str) -> dict[int, float]:
    return {r["step"]: r[METRIC] for r in read_metrics(workdir) if METRIC in r}


def test_two_workers_killed_at_random_points_score_every_trial_as_undisturbed(undisturbed, tmp_path):
    """Which parameters two workers draw depends on which finishes first; what must not: the count,
    every trial's values (those of its parameters trained undisturbed) and the best named."""
    rng = random.Random(int(os.environ.get("JAXRAT_FAULT_SEED", "0")) + 1)
    ref = undisturbed
    root = str(tmp_path / "two")
    logs = [str(tmp_path / f"worker{i}.log") for i in range(2)]
    procs = [_start(root, logs[i]) for i in range(2)]
    try:
        for _ in range(2):  # kill -9 one worker, or both at once, in one of the next trials; start them again
            victims = [0, 1] if rng.random() < 0.4 else [rng.randrange(2)]
            _wait_for_trial(root, _newest(root) + 1 + rng.randrange(2), procs[victims[0]])
            time.sleep(rng.uniform(0.0, 10.0))
            for i in victims:
                procs[i].kill()
                procs[i].wait(30)
            for i in victims:  # both recover the stale trials at once: they must not run one too many
                procs[i] = _start(root, logs[i])
        for p in procs:
            assert p.wait(900) == 0, "".join(open(x).read()[-2000:] for x in logs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    summary = _finish(root)  # nothing left to run: it only writes the summary
    _sane(summary, root)
    assert any(r["replaced"] for r in summary["trials"]), "no kill cut a trial short"
    curves = {_key(r["params"]): tune_summary.load_study(ref["root"]).trials[r["number"]].intermediate_values
              for r in _counted(ref)}
    for r in _counted(summary):
        trial = tune_summary.load_study(root).trials[r["number"]]
        want = curves.get(_key(r["params"]), {})
        if not set(trial.intermediate_values) <= set(want):  # parameters the single worker did not draw
            workdir = str(tmp_path / "reference" / f"trial_{r['number']}")
            cmd = train_command(TOY, workdir, [*tune.to_overrides(r["params"]), *COMMON])
            subprocess.run(cmd, cwd=REPO, env=env_with_devices(1), capture_output=True, timeout=600, check=True)
            want = _curve(workdir)
        assert trial.intermediate_values == {s: want[s] for s in trial.intermediate_values}, r
        assert r["value"] == want[r["last_step"]], r
        if r["state"] == "complete":
            assert r["last_step"] == 4 and r["run"] == "finished", r
