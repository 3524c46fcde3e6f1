"""Two real processes started by Open MPI's mpirun find each other through jaxrat.cluster.

Needs `mpirun` (Debian: openmpi-bin); installed on the fly when running as root with apt-get
(as in CI), otherwise the test is skipped without it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

# Each rank logs and writes its result to its own files: mpirun relays the ranks' output in chunks
# that can interleave mid-line, which once turned two RESULT lines into one garbled line in CI.
WORLD = """
import logging
import os
out = os.environ["RESULT_DIR"]
logging.basicConfig(level=logging.INFO, format="%(message)s",
                    filename=os.path.join(out, "log" + os.environ["OMPI_COMM_WORLD_RANK"]))
from jaxrat.cluster import initialize
info = initialize(None)
import jax.numpy as jnp
from jax.experimental import multihost_utils
total = multihost_utils.process_allgather(jnp.ones(2) * (info.process_index + 1)).sum()
with open(os.path.join(out, f"rank{info.process_index}"), "w") as f:
    f.write(f"{info.process_index} {info.process_count} {float(total)}")
"""


def ensure_mpirun() -> None:
    """Install Debian's openmpi-bin when missing and possible (root with apt-get), like CI does."""
    if shutil.which("mpirun"):
        return
    in_ci = os.environ.get("CI", "").lower() in ("1", "true", "yes")
    if os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        install = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "openmpi-bin"]
        for cmd in (install, ["apt-get", "update", "-qq"], install):  # refresh the lists only if needed
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
            if cmd is install and done.returncode == 0:
                break
    if shutil.which("mpirun"):
        return
    if in_ci:
        pytest.fail("CI must run the Open MPI test but mpirun is missing: apt-get install openmpi-bin")
    pytest.skip("mpirun not installed and cannot be installed here (apt-get install openmpi-bin)")


def test_mpirun_two_processes(tmp_path):
    ensure_mpirun()
    drop = ("SLURM_", "OMPI_", "PMIX_", "LSB_", "TORCHELASTIC_", "JAX_COORDINATOR", "XLA_FLAGS")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(JAX_NUM_CPU_DEVICES="2", JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", RESULT_DIR=str(tmp_path))
    cmd = ["mpirun", "--oversubscribe", "-np", "2", "-x", "JAX_NUM_CPU_DEVICES", "-x", "JAX_PLATFORMS",
           "-x", "PYTHONUNBUFFERED", "-x", "RESULT_DIR", sys.executable, "-c", WORLD]
    if os.geteuid() == 0:
        cmd.insert(1, "--allow-run-as-root")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"mpirun did not finish in 180 s:\n{err.stdout}\n{err.stderr}")
    log = proc.stdout + proc.stderr + "".join(p.read_text() for p in sorted(tmp_path.glob("log*")))
    assert proc.returncode == 0, log
    results = sorted(p.read_text().split() for p in tmp_path.glob("rank*"))
    assert results == [["0", "2", "6.0"], ["1", "2", "6.0"]], log
    for i in range(2):
        assert f"launcher=mpi process={i}/2 local_devices=2 local_device_ids=all global_devices=4" in log
