"""Test setup: 8 simulated CPU devices, set before anything imports jax; integration modules marked.

``pytest -m "not slow"`` is the fast inner loop: it leaves out every test that starts training
processes, clusters or notebooks (the modules below, and tests marked ``slow`` one by one).
"""

import os
import sys

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(__file__))

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
