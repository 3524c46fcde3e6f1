"""A real 3-variant sweep of the smoke config, trained one variant after another by
``python -m jaxrat.sweep --local``: every variant trains to its final checkpoint, the summary lists
all three with their metrics, and running the sweep again trains nothing."""

from __future__ import annotations

import csv
import subprocess
import sys

from runner import REPO, env_with_devices

TOY = "tests/toy/sweep_config.py"  # configs/isic.py:smoke, 4 steps; variants base, lr_high, wide


def sweep(root: str, *extra: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "jaxrat.sweep", "--config", TOY, "--root", root, "--local", *extra],
                          capture_output=True, text=True, timeout=600, cwd=REPO, env=env_with_devices(1))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def test_local_sweep_trains_summarizes_and_skips_finished(tmp_path):
    root = tmp_path / "sweep"
    first = sweep(str(root))
    for i, name in enumerate(["base", "lr_high", "wide"], 1):
        assert f"sweep [{i}/3] {name}: training: " in first.stdout
        assert (root / name / "checkpoints" / "4" / "commit_success.txt").is_file()
    rows = list(csv.DictReader((root / "summary.csv").open()))
    assert [r["run"] for r in rows] == ["base", "lr_high", "wide"]
    for r in rows:
        assert r["state"] == "finished" and r["step"] == "4" and r["eval step"] == "4"
        assert 0.0 <= float(r["eval/dice"]) <= 1.0 and r["best eval/dice step"] in ("2", "4")
    assert rows[1]["overrides"] == "optimizer.learning_rate=0.01" and rows[2]["overrides"] == "model.features=(8,16)"
    assert len({r["train/loss"] for r in rows}) == 3  # three different runs
    assert "| base | finished | 4 | 4 |" in (root / "summary.md").read_text()
    assert (root / "summary.png").stat().st_size > 0

    metrics = {name: (root / name / "metrics.jsonl").read_text() for name in ("base", "lr_high", "wide")}
    again = sweep(str(root))
    for i, name in enumerate(["base", "lr_high", "wide"], 1):
        assert f"sweep [{i}/3] {name}: finished (step 4), skipped" in again.stdout
        assert (root / name / "metrics.jsonl").read_text() == metrics[name]  # nothing was run
