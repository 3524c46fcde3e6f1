"""A bounded fault campaign for the experiment layer: a local sweep killed with -9 at random points,
then run again, ends with the same table of results as an undisturbed sweep (exactly: the runs are
deterministic and resume bit for bit). The training layer's campaign is tests/fault/test_chaos.py.

The points are drawn from ``JAXRAT_FAULT_SEED`` (default 0), so a failure can be replayed.
"""

from __future__ import annotations

import csv
import os
import random
import subprocess
import sys
import time

import pytest

from runner import REPO, env_with_devices

pytestmark = [pytest.mark.slow, pytest.mark.integration]

TOY = "tests/toy/sweep_config.py"  # configs/isic.py:smoke, 4 steps, eval and checkpoint every 2
COLUMNS = ("run", "state", "step", "eval step", "eval/dice", "eval/iou", "eval/loss")


def _cmd(root: str) -> list[str]:
    return [sys.executable, "-m", "jaxrat.sweep", "--config", TOY, "--root", root, "--local"]


def _table(root: str) -> list[tuple]:
    with open(os.path.join(root, "summary.csv")) as f:
        return [tuple(r.get(c) for c in COLUMNS) for r in csv.DictReader(f)]


def test_a_sweep_killed_at_random_points_ends_with_the_undisturbed_table(tmp_path):
    rng = random.Random(int(os.environ.get("JAXRAT_FAULT_SEED", "0")))
    env = env_with_devices(1)
    ref, root = str(tmp_path / "undisturbed"), str(tmp_path / "killed")
    t0 = time.monotonic()
    done = subprocess.run(_cmd(ref), cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    took = time.monotonic() - t0
    for _ in range(2):  # kill -9 twice, anywhere in the sweep (its trainings get SIGTERM from the kernel)
        proc = subprocess.Popen(_cmd(root), cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(1.0, took))
        proc.kill()
        proc.wait(30)
    again = subprocess.run(_cmd(root), cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert _table(root) == _table(ref)
    assert all(row[1] == "finished" for row in _table(root))
