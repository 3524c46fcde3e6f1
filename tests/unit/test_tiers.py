"""The test tiers (tests/conftest.py): markers from the folder, a file outside the tiers refused in one
sentence, each file's seconds kept from run to run for the hand-out order, the time per tier printed,
scripts/test.sh's tier arguments, and every ``tests/...`` path the docs and sources name exists.

The end-to-end checks run pytest on a throwaway suite of three one-line tests with a copy of this
suite's conftest.py (no jax is imported), about a second of CPU a run.
"""

from __future__ import annotations

import json
import os
import re
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TESTS, hand_out_seconds, seed_times, tier_of

INI = """[pytest]
markers =
    unit: u
    integration: i
    fault: f
    slow: s
"""


@pytest.fixture
def suite(tmp_path: Path) -> Path:
    tests = tmp_path / "tests"
    for tier, body in (("unit", "pass"), ("integration", "time.sleep(0.3)"), ("fault", "pass")):
        (tests / tier).mkdir(parents=True)
        (tests / tier / f"test_{tier}_one.py").write_text(f"import time\n\n\ndef test_it():\n    {body}\n")
    shutil.copy(TESTS / "conftest.py", tests / "conftest.py")
    (tmp_path / "pytest.ini").write_text(INI)
    return tmp_path


def _pytest(root: Path, *args: str) -> subprocess.CompletedProcess:
    # -p no:xdist: three tests need no workers (the hand-out order is tested in-process below).
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", *args], cwd=root,
                          capture_output=True, text=True, timeout=120)


def _seconds(root: Path) -> dict[str, float]:
    return json.loads((root / ".pytest_cache" / "v" / "jaxrat" / "file_seconds").read_text())


def test_markers_follow_the_folder_and_slow_is_integration_and_fault(suite):
    for select, tiers in (("unit", ["unit"]), ("not slow", ["unit"]), ("slow", ["fault", "integration"])):
        proc = _pytest(suite, "--collect-only", "-m", select)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        chosen = sorted(line.split("/")[1] for line in proc.stdout.splitlines() if "::test_it" in line)
        assert chosen == sorted(tiers), (select, proc.stdout)


def test_each_file_s_seconds_are_kept_merged_and_the_time_per_tier_printed(suite):
    proc = _pytest(suite)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "time per tier" in proc.stdout
    tiers = {line.split()[0] for line in proc.stdout.split("time per tier", 1)[1].splitlines()[1:] if line.strip()}
    assert {"unit", "integration", "fault"} <= tiers, proc.stdout
    first = _seconds(suite)
    assert set(first) == {"unit/test_unit_one.py", "integration/test_integration_one.py", "fault/test_fault_one.py"}
    assert first["integration/test_integration_one.py"] >= 0.3 > first["unit/test_unit_one.py"]

    # A run of one tier updates its files and keeps the others' times for the next full run's order;
    # a run of some of a file's tests (-k, a node id) leaves its time alone.
    slower = "import time\n\n\ndef test_it():\n    time.sleep(0.5)\n"
    (suite / "tests" / "unit" / "test_unit_one.py").write_text(slower)
    for picked in (["-k", "test_it"], ["tests/unit/test_unit_one.py::test_it"]):
        assert _pytest(suite, *picked).returncode == 0
        assert _seconds(suite) == first, picked
    assert _pytest(suite, "tests/unit").returncode == 0
    second = _seconds(suite)
    assert second["unit/test_unit_one.py"] >= 0.5
    assert second["integration/test_integration_one.py"] == first["integration/test_integration_one.py"]
    assert second.keys() == first.keys()


def test_a_test_file_outside_the_tiers_stops_the_run_in_one_sentence(suite):
    (suite / "tests" / "test_stray.py").write_text("def test_it():\n    pass\n")
    proc = _pytest(suite)
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, proc.stdout + proc.stderr
    assert ("tests/test_stray.py is not in a tier: move it into tests/unit, tests/integration, tests/fault or "
            "tests/extended with git mv") in proc.stderr


def test_the_hand_out_order_is_the_last_run_s_longest_first_else_the_tier_s():
    files = ["unit/test_a.py", "integration/test_b.py", "fault/test_c.py", "unit/test_d.py"]
    order = lambda last: sorted(files, key=lambda key: -hand_out_seconds(key, last))  # noqa: E731
    # No report yet (a fresh clone): the campaigns first, the unit files last, collection order within.
    assert order({}) == ["fault/test_c.py", "integration/test_b.py", "unit/test_a.py", "unit/test_d.py"]
    # A report: its times, longest first; a file it lacks (new since) counts as its tier's.
    last = {"unit/test_a.py": 400.0, "fault/test_c.py": 0.5, "unit/test_d.py": 1.0}
    assert order(last) == ["unit/test_a.py", "integration/test_b.py", "unit/test_d.py", "fault/test_c.py"]


def test_a_fresh_clone_hands_out_from_the_committed_times_and_the_script_refreshes_them(tmp_path):
    # tests/file_seconds.json: a whole run's times, so that CI (no cache) starts the longest files first.
    seed = seed_times()
    assert seed, "tests/file_seconds.json is missing: run the suite, then python scripts/save_test_times.py"
    assert all((TESTS / key).is_file() and tier_of(TESTS / key) for key in seed), "times of files that are gone"
    save = runpy.run_path(str(TESTS.parent / "scripts" / "save_test_times.py"))
    (tmp_path / "unit").mkdir()
    for name in ("unit/test_a.py", "unit/test_b.py"):
        (tmp_path / name).write_text("")
    got = save["merged"]({"unit/test_b.py": 9.04, "unit/test_gone.py": 3.0}, {"unit/test_a.py": 2.0,
                                                                            "unit/test_b.py": 1.0}, tmp_path)
    assert list(got.items()) == [("unit/test_b.py", 9.0), ("unit/test_a.py", 2.0)]


def test_the_test_processes_and_the_runs_they_start_compile_at_the_test_flags():
    # tests/conftest.py: LLVM -O0 for everything the suite compiles, unless JAXRAT_TEST_XLA_FLAGS says otherwise.
    from runner import env_with_devices

    flags = os.environ["JAXRAT_TEST_XLA_FLAGS"]
    assert flags in os.environ["XLA_FLAGS"] and "--xla_force_host_platform_device_count=" in os.environ["XLA_FLAGS"]
    child = env_with_devices(2)["XLA_FLAGS"].split()
    assert child[0] == "--xla_force_host_platform_device_count=2" and child[1:] == flags.split()


def test_every_test_file_is_in_a_tier():
    assert tier_of(Path(__file__)) == "unit"
    assert tier_of(TESTS / "runner.py") is None
    assert not list(TESTS.glob("test_*.py")), "test files belong in a tier's folder (tests/unit, ...)"


DEFAULT_TIERS = ["tests/unit", "tests/integration", "tests/fault"]


@pytest.mark.parametrize("args, pytest_args", [
    ([], DEFAULT_TIERS),
    (["unit"], ["tests/unit"]),
    (["integration", "fault", "-k", "ema", "-x"], ["tests/integration", "tests/fault", "-k", "ema", "-x"]),
    (["-m", "not slow"], [*DEFAULT_TIERS, "-m", "not slow"]),
    (["extended"], ["tests/extended"]),
    (["all", "-x"], ["tests", "-x"]),
])
def test_the_test_script_runs_the_tiers_named_and_passes_the_rest_to_pytest(tmp_path, args, pytest_args):
    # scripts/test.sh in a copy of the clone whose setup scripts, ruff and python only say what they got.
    (tmp_path / "scripts").mkdir()
    shutil.copy(TESTS.parent / "scripts" / "test.sh", tmp_path / "scripts" / "test.sh")
    for name in ("scripts/setup_venv.sh", "scripts/setup_gpu_aot.sh"):
        (tmp_path / name).write_text("true\n")
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    for name in ("ruff", "python"):
        (tmp_path / ".venv" / "bin" / name).write_text(f'#!/bin/sh\nprintf "%s\\n" {name} "$@"\n')
        (tmp_path / ".venv" / "bin" / name).chmod(0o755)
    proc = subprocess.run(["bash", str(tmp_path / "scripts" / "test.sh"), *args], capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    called = lines[lines.index("python") + 1:]
    assert called == ["-m", "pytest", "-q", "-ra", "--durations=15", "-n", "2", "--dist", "loadfile",
                      "--max-worker-restart=0", *pytest_args]
    assert lines[:2] == ["ruff", "check"]


# A path under tests/ as the docs and comments write it: tests/unit/test_docs.py, tests/toy/toy_config.py.
_TESTS_PATH = re.compile(r"(?<![\w./-])tests/[\w/.-]*\w\.(?:py|sh|json)")


def test_every_tests_path_the_docs_and_sources_name_exists():
    repo = TESTS.parent
    named = [*repo.glob("*.md"), *repo.glob("docs/*.md"), repo / "pyproject.toml", *repo.glob("scripts/*"),
             *repo.glob("jaxrat/**/*.py"), *repo.glob("benchmarks/*.py"), *repo.glob("configs/*.py"),
             *(p for p in TESTS.rglob("*.py") if p != Path(__file__))]  # this file names a stray one on purpose
    missing = [f"{path.relative_to(repo)}: {found}" for path in named if path.is_file()
               for found in _TESTS_PATH.findall(path.read_text(encoding="utf-8")) if not (repo / found).exists()]
    assert not missing, "these name test files that are not there (moved to a tier?):\n" + "\n".join(missing)


@pytest.mark.parametrize("pip_status", [0, 1])
def test_the_setup_passes_pip_its_arguments_and_stops_when_pip_fails(tmp_path, pip_status):
    """The test script installs with --no-compile; a pip that fails (a package it cannot get) stops the
    setup with pip's own messages, not a run that fails later on a missing import."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(TESTS.parent / "scripts" / "setup_venv.sh", tmp_path / "scripts" / "setup_venv.sh")
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    pip = tmp_path / ".venv" / "bin" / "pip"
    pip.write_text(f'#!/bin/sh\necho "pip got: $*"\necho "no matching distribution for torch" >&2\nexit {pip_status}\n')
    python = tmp_path / ".venv" / "bin" / "python"
    python.write_text('#!/bin/sh\necho "imported"\n')
    for exe in (pip, python):
        exe.chmod(0o755)
    proc = subprocess.run(["bash", str(tmp_path / "scripts" / "setup_venv.sh"), "dev,reference", "--no-compile"],
                          capture_output=True, text=True, timeout=30)
    pip_args = "install --quiet --disable-pip-version-check --no-compile -e .[dev,reference]"
    assert f"pip got: {pip_args}" in proc.stdout + proc.stderr
    if pip_status:
        assert proc.returncode == 1 and "imported" not in proc.stdout
        assert "no matching distribution for torch" in proc.stderr
        assert "pip could not install jaxrat[dev,reference]" in proc.stderr
    else:
        assert proc.returncode == 0 and proc.stdout.splitlines()[-1] == "imported", proc.stderr
