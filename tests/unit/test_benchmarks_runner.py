"""benchmarks/run_all.py: runs each benchmark as a subprocess and keeps going when one fails."""

import json
import sys
from pathlib import Path

from benchmark_scripts import load

REPO = Path(__file__).resolve().parents[2]


def load_run_all():
    return load("run_all")


def test_every_listed_benchmark_exists_and_takes_out():
    run_all = load_run_all()
    for name in run_all.BENCHMARKS:
        text = (REPO / "benchmarks" / f"{name}.py").read_text()
        assert '"--out"' in text, name


def test_summary_keeps_results_and_failures(tmp_path, monkeypatch):
    run_all = load_run_all()
    bench = tmp_path / "benchmarks"
    bench.mkdir()
    (bench / "good.py").write_text(
        "import json, sys\nout = sys.argv[sys.argv.index('--out') + 1]\n"
        "print('size  time\\n64    1.0')\njson.dump({'rows': [[64, 1.0]]}, open(out, 'w'))\n")
    (bench / "bad.py").write_text("import sys\nprint('starting')\nsys.exit('out of memory at 1024 px')\n")
    monkeypatch.setattr(run_all, "REPO", tmp_path)
    monkeypatch.setattr(run_all, "BENCHMARKS", {"good": (["--x"], []), "bad": ([], [])})
    monkeypatch.setattr(sys, "argv", ["run_all.py", "--quick", "--results", str(tmp_path / "out")])
    try:
        run_all.main()
        raise AssertionError("a failed benchmark must make run_all exit non-zero")
    except SystemExit as e:
        assert e.code == 1
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["quick"] and summary["machine"]["cores"] >= 1
    good, bad = summary["benchmarks"]["good"], summary["benchmarks"]["bad"]
    assert good["status"] == "ok" and good["result"] == {"rows": [[64, 1.0]]} and "64    1.0" in good["table"]
    assert bad["status"] == "failed (1)" and "out of memory at 1024 px" in bad["error"]
    md = (tmp_path / "out" / "SUMMARY.md").read_text()
    assert "| good | ok |" in md and "| bad | failed (1) |" in md and "python benchmarks/good.py --x" in md
