"""Every benchmark runs in its smallest form (``benchmarks/run_all.py --smoke``), so none rots unnoticed.

``benchmarks/checkpoint_stall.py`` ended in a TypeError at its json.dump for months (a ConfigDict in
its results) and no test noticed; the README quotes its figure. The numbers at these sizes mean
nothing; what is checked is that each script runs to its end and writes its JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmark_scripts import load
from conftest import TEST_XLA_FLAGS

pytestmark = pytest.mark.benchmarks  # the tier's markers follow the folder (tests/conftest.py)

REPO = Path(__file__).resolve().parents[2]


def _scripts() -> list[str]:
    """The benchmarks: scripts of benchmarks/ that run as a program (not run_all, not helper modules)."""
    return sorted(p.stem for p in (REPO / "benchmarks").glob("*.py")
                  if p.stem != "run_all" and 'if __name__ == "__main__"' in p.read_text())


def test_every_benchmark_has_a_smoke_and_a_quick_form():
    run_all = load("run_all")
    assert _scripts() == sorted({*run_all.SMOKE, *run_all.GPU_ONLY})
    assert sorted(run_all.SMOKE) == sorted(run_all.BENCHMARKS)


@pytest.mark.timeout(3600)  # a dozen scripts, each compiling its own programs: past the suite's 900 s
def test_every_benchmark_runs_in_its_smoke_form(tmp_path):
    # As a user runs them, but for LLVM's optimisation level: the suite's 8 simulated devices
    # (tests/conftest.py) do not divide their batches, and at these sizes compiling is nearly all the
    # time, which -O0 cuts by ~40% (their numbers mean nothing here either way).
    env = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, "XLA_FLAGS": TEST_XLA_FLAGS}
    run_all = load("run_all")
    only = [name for name in run_all.SMOKE if name not in run_all.SMOKE_TESTED_BY]
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "run_all.py"), "--smoke", "--results",
                           str(tmp_path), "--only", *only], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=3600)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert sorted(summary["benchmarks"]) == sorted(only)
    failed = {n: r.get("error", "")[-1500:] for n, r in summary["benchmarks"].items() if r["status"] != "ok"}
    assert proc.returncode == 0 and not failed, failed or proc.stderr[-3000:]
    assert all((tmp_path / f"{name}.json").is_file() for name in summary["benchmarks"])


def test_the_smoke_forms_left_to_their_own_tests_are_run_there():
    """What run_all.SMOKE_TESTED_BY leaves out above, its test runs: the script, with every smoke argument."""
    run_all = load("run_all")
    assert set(run_all.SMOKE_TESTED_BY) <= set(run_all.SMOKE)
    for name, test in run_all.SMOKE_TESTED_BY.items():
        text = (REPO / test).read_text()
        assert f"benchmarks/{name}.py" in text or f'load("{name}")' in text, (name, test)
        missing = [arg for arg in run_all.SMOKE[name] if f'"{arg}"' not in text]
        assert not missing, f"{test} does not run {name} with {missing}"
