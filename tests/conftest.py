"""Test setup: 8 simulated CPU devices, set before anything imports jax; one compilation cache for the
whole run; integration modules marked.

``pytest -m "not slow"`` is the fast inner loop: it leaves out every test that starts training
processes, clusters or notebooks (the modules below, and tests marked ``slow`` one by one).
"""

import os
import shutil
import sys
import tempfile

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(__file__))

from file_costs import COSTS, DEFAULT  # noqa: E402

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


def pytest_unconfigure(config: pytest.Config) -> None:
    # Only the process that made the folder removes it (the xdist controller, or a plain pytest run).
    if _RUN_CACHE_OWNER and not os.environ.get("JAXRAT_TEST_CACHE_DIR") and not hasattr(config, "workerinput"):
        shutil.rmtree(os.environ["JAXRAT_TEST_RUN_CACHE"], ignore_errors=True)

# Whole modules of integration tests: real subprocesses (python -m jaxrat.main, jax.distributed on
# 127.0.0.1, mpirun), a real SLURM cluster, or notebooks run top to bottom.
INTEGRATION_MODULES = {
    "test_checkpoint_kill", "test_cli_errors", "test_colabs", "test_data_training", "test_distributed_init",
    "test_distributed_mpi", "test_multiprocess", "test_preempt", "test_preempt_multiprocess", "test_slurm",
    "test_sweep_run", "test_task_runs", "test_tracking_runs", "test_training",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.module.__name__.rpartition(".")[2] in INTEGRATION_MODULES:
            item.add_marker(pytest.mark.integration)
            item.add_marker(pytest.mark.slow)
        elif item.get_closest_marker("integration"):
            item.add_marker(pytest.mark.slow)
    if hasattr(config, "workerinput"):
        # Under pytest-xdist (scripts/test.sh: -n 2 --dist loadfile) files are handed out in the
        # workers' collection order: longest first (tests/file_costs.py), so that the last files to
        # start are short ones and both workers finish at about the same time.
        items.sort(key=lambda item: -COSTS.get(item.path.name, DEFAULT))


def pytest_configure(config: pytest.Config) -> None:
    # xdist would otherwise hand out the files with the most tests first, undoing the order above.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
