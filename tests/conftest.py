"""Test setup: 8 simulated CPU devices, set before anything imports jax; one compilation cache for the
whole run; tiers from the folders; test files handed out longest first from the last run's times.

The tiers are folders, and their markers follow the folder (nothing to list here):

* ``tests/unit``: in-process (at most a short helper process: a ``--help``, ``bash -n``, a fake
  ``sbatch``), no training run, seconds a file. ``bash scripts/test.sh unit`` is the inner loop.
* ``tests/integration``: training subprocesses, real multi-process runs, notebooks, whole-model
  compiles and parity.
* ``tests/fault``: kill -9 campaigns, chaos, preemption, dead peers, full disks, the real SLURM cluster.
* ``tests/extended``: the opt-in GPU kernels (Pallas, in interpret mode here), programs compiled for an
  H100 (ptxas, cost counts), the benchmark scripts and the ONNX conversion of the model families the
  integration tier leaves out. Not in ``bash scripts/test.sh`` (CI's run), which
  must finish within CI's 90 minutes on 2 cores; ``bash scripts/test.sh extended`` (or ``all``) runs it,
  and a change to jaxrat/ops/gpu, the GPU policy or benchmarks/ must pass it.

``integration``, ``fault`` and ``extended`` tests are also marked ``slow``, so ``-m "not slow"`` selects
the unit tier. A test file outside the tiers stops the run with one sentence. The helpers (``runner``,
``model_configs``, ``toy/``, ...) stay in ``tests/``.
"""

import json
import os
import re
import shutil
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
TESTS = Path(__file__).resolve().parent

# How XLA:CPU compiles every program of the test run: in the test processes, and in the training runs they
# start (they inherit XLA_FLAGS, and tests/runner.py adds these to the XLA_FLAGS it sets). The suite's time
# is mostly XLA:CPU compiling small programs that then run a few steps on tiny shapes, so both flags trade
# run time for compile time:
# - LLVM at -O0. Measured on the 2-core machine: the ISIC smoke training run 27.2 -> 12.1 s wall with a cold
#   compilation cache (42.7 -> 14.6 s user), 9.2 -> 7.9 s warm; the COCO demo's 4 steps 69.6 -> 55.4 s; a
#   tiny RAT's forward and backward 72 -> 42 s. XLA's own HLO passes still run, so the numbers are the same.
# - XLA's elemental kernel emitters instead of its newer MLIR fusion emitters, which spend most of a small
#   program's compile in MLIR. Measured on a 2-core Zen 5 machine: test_window_attention, test_training and
#   test_sga 157 -> 102 s (208 -> 119 s of CPU); test_kernel_policy's cpu/portable comparison 30 -> 17 s.
#   Kernels fuse and round alike but not always to the bit: a test that compares two programs bit for bit
#   compiles them as users do (``USER_COMPILE`` below).
# What it costs is step time: the ISIC demo RAT trained 20 steps in 120 s against 90 s at -O0, so a test
# that times steps or trains a RAT long sets XLA_FLAGS itself. JAXRAT_TEST_XLA_FLAGS="" runs the whole suite
# at XLA's defaults.
TEST_XLA_FLAGS = os.environ.setdefault("JAXRAT_TEST_XLA_FLAGS",
                                       "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false")
# ``compiler_options`` for a test that compiles in its own process two programs whose bits it compares:
# the kernel emitters users get.
USER_COMPILE = {"xla_cpu_use_fusion_emitters": True}
if TEST_XLA_FLAGS and TEST_XLA_FLAGS not in os.environ["XLA_FLAGS"] and (TESTS.parent / "jaxrat").is_dir():
    os.environ["XLA_FLAGS"] += f" {TEST_XLA_FLAGS}"  # not in tests/unit/test_tiers.py's throwaway suite
# The training runs the suite starts import jaxrat afresh each time; where the environment forbids
# bytecode files (PYTHONDONTWRITEBYTECODE, as on our development machines), each one compiled ~140 modules from
# source, ~0.7 s of CPU a run. The bytecode goes to __pycache__ folders that git ignores.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False
TIERS = ("unit", "integration", "fault", "extended")
# The helpers in tests/, and every tier's folder: a test module may import another's helpers
# (``from test_preempt import Run``) whichever tier either is in, and whichever tiers this run collects.
for _folder in (TESTS, *(TESTS / tier for tier in TIERS)):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

# One persistent XLA compilation cache for the whole test run, shared by this process, the xdist
# workers and every subprocess (they inherit the environment; jaxrat.runtime.compile_cache.default_dir and
# jax's own flag both read JAX_COMPILATION_CACHE_DIR): most tests compile the same few smoke programs,
# each in a fresh process, so all but the first compile become cache reads. Every entry is cached, not
# only the slow ones, because a test run is made of many small compiles. A fresh folder per run keeps
# the run honest (nothing warm from a previous one); JAXRAT_TEST_CACHE_DIR names one to keep instead.
_RUN_CACHE_OWNER = "JAXRAT_TEST_RUN_CACHE" not in os.environ
if _RUN_CACHE_OWNER:
    os.environ["JAXRAT_TEST_RUN_CACHE"] = os.environ.get("JAXRAT_TEST_CACHE_DIR") or tempfile.mkdtemp(
        prefix="jaxrat-test-xla-")
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ["JAXRAT_TEST_RUN_CACHE"]
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"


def _stop_searching_for_triton_bindings() -> None:
    """Lowering a Pallas kernel for Triton asks MLIR's Python bindings for the ``tt`` dialect's module at
    every op and type; MLIR tries ``<prefix>.tt`` under each of its search prefixes, none exists, and a
    failed import is not remembered, so each lookup walks sys.path (long under pytest, and through its
    assertion-rewriting finder): thousands of failed imports per GPU program, ~40% of the time lowering
    the COCO RAT-DETR step for CUDA. ``None`` in sys.modules makes the same import fail at once, with the
    same ModuleNotFoundError (the lowered text is byte for byte the same). Nothing here imports jax."""
    import importlib.util

    jax_spec = importlib.util.find_spec("jax")  # a top-level name: found, not imported
    jax_jaxlib = bool(jax_spec and jax_spec.origin and (Path(jax_spec.origin).parent / "jaxlib").exists())
    for name in ("jaxlib.mlir.dialects.tt", "jaxlib.mosaic.python.tt", "jax.jaxlib.mosaic.python.tt"):
        if name.startswith("jax."):
            found = jax_jaxlib  # the rest would be found by importing jax, which must come later
        else:
            try:
                found = importlib.util.find_spec(name) is not None  # imports jaxlib's packages, not jax
            except ImportError:
                found = False
        if not found:
            sys.modules.setdefault(name, None)


_stop_searching_for_triton_bindings()


def pytest_unconfigure(config: pytest.Config) -> None:
    # Only the process that made the folder removes it (the xdist controller, or a plain pytest run).
    if _RUN_CACHE_OWNER and not os.environ.get("JAXRAT_TEST_CACHE_DIR") and not hasattr(config, "workerinput"):
        shutil.rmtree(os.environ["JAXRAT_TEST_RUN_CACHE"], ignore_errors=True)

# Seconds a test file counts for in the hand-out order when the last run's report does not have it:
# campaigns first, then the integration files, the unit files last (they are short and fill the gaps).
TIER_SECONDS = {"fault": 120.0, "integration": 30.0, "extended": 30.0, "unit": 3.0}
# Per test file (path under tests/), the seconds its tests took (setup, call and teardown) in the last
# run that ran it, kept in pytest's cache (.pytest_cache/v/jaxrat/file_seconds).
DURATIONS_KEY = "jaxrat/file_seconds"
# A fresh clone (CI) has no cache: it hands out from per-file times committed here (the first version
# from the last landed run's times plus estimates for newer files; ``python scripts/save_test_times.py``
# after a whole run replaces them with that run's).
SEED_TIMES = TESTS / "file_seconds.json"


def seed_times() -> dict[str, float]:
    """The committed per-file seconds (empty when the file is missing or unreadable)."""
    try:
        return {str(k): float(v) for k, v in json.loads(SEED_TIMES.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def tier_of(path: Path) -> str | None:
    """``unit``, ``integration`` or ``fault`` for a test file under those folders; None elsewhere."""
    try:
        parts = path.resolve().relative_to(TESTS).parts
    except ValueError:
        return None
    return parts[0] if len(parts) > 1 and parts[0] in TIERS else None


def _file_key(nodeid: str) -> str:
    # Node ids are relative to the rootdir (the clone): "tests/unit/test_docs.py::test_links[README.md]".
    return nodeid.split("::", 1)[0].removeprefix("tests/")


def hand_out_seconds(key: str, last: dict[str, float]) -> float:
    """Seconds ``key`` (a test file under tests/) is expected to take: the last run's, else its tier's."""
    if key in last:
        return float(last[key])
    return TIER_SECONDS.get(key.split("/", 1)[0], TIER_SECONDS["integration"])


def stray_test_files() -> list[str]:
    """Test files under tests/ but in no tier's folder (e.g. one a branch added before the tiers)."""
    return sorted(str(path.relative_to(TESTS.parent)) for path in TESTS.rglob("test_*.py")
                  if tier_of(path) is None)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        tier = tier_of(item.path)
        if tier:
            item.add_marker(getattr(pytest.mark, tier))
        if tier in ("integration", "fault", "extended") or item.get_closest_marker("integration"):
            item.add_marker(pytest.mark.slow)
    if hasattr(config, "workerinput"):
        # Under pytest-xdist (scripts/test.sh: -n 2 --dist loadfile) files are handed out in the
        # workers' collection order: longest first, from the last run's times, so that the last files
        # to start are short ones and both workers finish at about the same time. A missing or stale
        # time makes the run slower, never wrong.
        cache = getattr(config, "cache", None)  # None under -p no:cacheprovider
        last = {**seed_times(), **(cache.get(DURATIONS_KEY, {}) if cache else {})}
        items.sort(key=lambda item: -hand_out_seconds(_file_key(item.nodeid), last))


def _whole_files(session: pytest.Session, exitstatus: int) -> bool:
    """Whether this run ran each of its files whole, so that their times stand for the files: not when
    ``-k``, a marker other than the tiers' or a test's node id picked some of a file's tests, nor when
    it stopped early (-x, Ctrl-C)."""
    option, args = session.config.option, session.config.args
    markers = set(re.findall(r"\w+", option.markexpr or "")) - {*TIERS, "slow", "and", "or", "not"}
    picked = option.keyword or markers or any("::" in str(arg) for arg in args)
    stopped = exitstatus == pytest.ExitCode.INTERRUPTED or session.shouldfail or session.shouldstop
    return not picked and not stopped


class _Durations:
    """Seconds per test file and per tier in this run, written to pytest's cache at its end (in the
    process that sees every report: the xdist controller, or a plain pytest run)."""

    def __init__(self) -> None:
        self.files: dict[str, float] = defaultdict(float)
        self.tests: dict[str, int] = defaultdict(int)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        key = _file_key(report.nodeid)
        self.files[key] += report.duration
        if report.when == "call" or (report.when == "setup" and report.skipped):
            self.tests[key] += 1

    def per_tier(self) -> dict[str, tuple[float, int]]:
        totals: dict[str, tuple[float, int]] = {}
        for key, seconds in self.files.items():
            tier = key.split("/", 1)[0] if key.split("/", 1)[0] in TIERS else "other"
            was_seconds, was_tests = totals.get(tier, (0.0, 0))
            totals[tier] = (was_seconds + seconds, was_tests + self.tests[key])
        return totals

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        cache = getattr(session.config, "cache", None)
        if cache is None or not self.files or not _whole_files(session, exitstatus):
            return
        # Files this run did not run (another tier) keep their last time.
        cache.set(DURATIONS_KEY, {**cache.get(DURATIONS_KEY, {}),
                                  **{key: round(seconds, 2) for key, seconds in self.files.items()}})

    def pytest_terminal_summary(self, terminalreporter) -> None:
        totals = self.per_tier()
        if not totals:
            return
        terminalreporter.section("time per tier (seconds of tests, all workers together)")
        for tier in (*TIERS, "other"):
            if tier in totals:
                seconds, tests = totals[tier]
                terminalreporter.write_line(f"{tier:<12} {seconds:8.1f} s  {tests:5d} tests")


def pytest_configure(config: pytest.Config) -> None:
    # xdist would otherwise hand out the files with the most tests first, undoing the order above.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    if not hasattr(config, "workerinput"):
        astray = stray_test_files()
        if astray:
            raise pytest.UsageError(
                f"{', '.join(astray)} is not in a tier: move it into tests/unit, tests/integration, "
                "tests/fault or tests/extended with git mv (README.md says which is which).")
        config.pluginmanager.register(_Durations(), "jaxrat-durations")
