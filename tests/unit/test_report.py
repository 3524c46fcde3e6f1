"""python -m jaxrat.report: one page from sweeps (with folds/seeds), a search, a robustness table
and a single run, with the summaries' own numbers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import optuna

from jaxrat.experiments import stats, summary, sweep, tune, tune_summary
from test_sweep import fake_run

REPO = Path(__file__).resolve().parents[2]
TOY = str(REPO / "tests/toy/sweep_config.py")


def _study_root(tmp_path: Path) -> Path:
    root = tmp_path / "study"
    abl = root / "ablation"
    runs = []
    for variant, shift in (("baseline", 0.0), ("pe_none", -0.1)):
        for fold in range(3):
            name = f"{variant}-f{fold}"
            fake_run(abl, name, [{"step": 4, "eval/dice": 0.6 + shift + 0.01 * fold}])
            config = json.loads((abl / name / "config.json").read_text())
            config["model"] = {"positional_encoding": "none" if variant == "pe_none" else "rose"}
            (abl / name / "config.json").write_text(json.dumps(config))
            runs.append(sweep.Variant(name, (), variant, fold, None))
    (abl / "baseline-f0" / "summary.json").write_text(json.dumps({
        "status": "finished", "hardware": {"device_count": 8, "device_kind": "H100", "host": "node7"},
        "code": {"commit": "0123456789abcdef0123", "dirty": True}, "wall_time_s": 12.5}))
    sweep.write_manifest(str(abl), TOY, runs, [])
    search = root / "search"
    search.mkdir()
    (search / tune_summary.SETTINGS).write_text(json.dumps({"config": TOY, "metric": "eval/dice", "common": []}))
    study = tune.open_study(str(search), "maximize")
    for lr, value in ((1e-3, 0.5), (1e-2, 0.7)):
        t = study.ask()
        t.suggest_float("optimizer.learning_rate", 1e-4, 1e-1, log=True)
        t.set_user_attr("overrides", [f"--config.optimizer.learning_rate={lr}"])
        study.tell(t, value)
    t = study.ask()
    study.tell(t, state=optuna.trial.TrialState.PRUNED)
    single = root / "one"
    fake_run(root, "one", [{"step": 4, "eval/dice": 0.9}])
    (single / "robustness").mkdir()
    (single / "robustness" / "table.md").write_text("# Robustness\n\n| size | eval/dice |\n|---|---|\n| 64 | 0.8 |\n")
    return root


def test_the_report_holds_the_summaries_numbers_and_reads_only(tmp_path):
    root = _study_root(tmp_path)
    before = sorted(p for p in root.rglob("*") if p.is_file())
    proc = subprocess.run([sys.executable, "-m", "jaxrat.report", str(root)], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    made = sorted(p for p in root.rglob("*") if p.is_file())
    new = {str(p.relative_to(root)) for p in set(made) - set(before)}
    assert {"report.md", "report.html", "report_files/curves_ablation.png"} <= new
    assert all(n.startswith(("report", "report_files/")) for n in new)  # nothing else written
    page = (root / "report.md").read_text()

    abl = str(root / "ablation")
    text, numbers = summary.study_markdown(abl, summary.collect(abl))
    for line in text.splitlines():
        if line.startswith("| pe_none") or line.startswith("| baseline"):
            assert line in page, line
    d = numbers["paired"]["pe_none"]["eval/dice"]
    assert d["n"] == 3 and abs(d["mean"] + 0.1) < 1e-9
    assert numbers == stats.compute(abl, summary.collect(abl))
    assert "| pe_none-f1 | model.positional_encoding=none |" in page
    assert "| baseline-f0 | finished | 8 x H100 | node7 | 0123456789ab (uncommitted changes) | 12.5 |" in page
    assert "## Search: search" in page and "pruned: 2" in page and "| optimizer.learning_rate |" in page
    assert "## Robustness: one" in page and "| 64 | 0.8 |" in page
    assert "## Single runs" in page and "| one | finished |" in page
    html = (root / "report.html").read_text()
    assert "<table>" in html and '<img src="report_files/curves_ablation.png"' in html and "± " in html
