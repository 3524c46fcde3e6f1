"""A real sweep over folds (``--folds 3``) of the toy smoke config: 6 runs trained, a rerun trains
nothing, and the summary's mean ± sd and paired differences are recomputed here from the runs'
metrics.jsonl."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from scipy import stats as sps

from runner import REPO, env_with_devices, read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.integration]
TOY = "tests/toy/sweep_config.py"


def _sweep(root: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "jaxrat.sweep", "--config", TOY, "--root", root, "--only",
                           "base,lr_high", "--folds", "3"], capture_output=True, text=True, timeout=1200, cwd=REPO,
                          env=env_with_devices(1))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_a_sweep_over_folds_trains_summarizes_and_skips_finished(tmp_path):
    root = str(tmp_path / "cv")
    first = _sweep(root)
    names = [f"{v}-f{f}" for v in ("base", "lr_high") for f in range(3)]
    for i, name in enumerate(names, 1):
        assert f"sweep [{i}/6] {name}: training: " in first.stdout
    assert len(os.listdir(os.path.join(root, "folds"))) == 1  # one assignment, shared by all six runs
    again = _sweep(root)
    assert "training" not in again.stdout and again.stdout.count("finished (step 4), skipped") == 6

    last = {n: [r for r in read_metrics(os.path.join(root, n)) if "eval/dice" in r][-1]["eval/dice"] for n in names}
    got = json.load(open(os.path.join(root, "summary_stats.json")))
    for v in ("base", "lr_high"):
        values = [last[f"{v}-f{f}"] for f in range(3)]
        d = got["variants"][v]["metrics"]["eval/dice"]
        assert d["n"] == 3 and d["mean"] == pytest.approx(np.mean(values))
        assert d["sd"] == pytest.approx(np.std(values, ddof=1))
    a = np.array([last[f"lr_high-f{f}"] for f in range(3)])
    b = np.array([last[f"base-f{f}"] for f in range(3)])
    p = got["paired"]["lr_high"]["eval/dice"]
    half = sps.t.ppf(0.975, 2) * (a - b).std(ddof=1) / math.sqrt(3)
    assert p["mean"] == pytest.approx((a - b).mean()) and p["ci95"][1] == pytest.approx((a - b).mean() + half)
    assert p["t_test_p"] == pytest.approx(sps.ttest_rel(a, b).pvalue)
    md = open(os.path.join(root, "summary.md")).read()
    assert f"| lr_high | 3/3 | {a.mean():.4f} ± {a.std(ddof=1):.4f} |" in md and "| wide |" not in md
