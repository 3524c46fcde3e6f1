"""Real ``jax.distributed`` initialisation in subprocesses: success, and failures that must end
with one sentence and exit status 2 instead of hanging or aborting with a C++ stack trace."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

INIT = """
import logging, sys
logging.basicConfig(level=logging.INFO, format="%(message)s")
import jax
jax.config.update("jax_num_cpu_devices", 2)
from jaxrat.cluster import initialize
info = initialize(dict(coordinator_address=sys.argv[1], num_processes=int(sys.argv[2]),
                       process_id=int(sys.argv[3]), initialization_timeout=int(sys.argv[4])))
import jax.numpy as jnp
from jax.experimental import multihost_utils
total = multihost_utils.process_allgather(jnp.arange(2.0) + 2 * info.process_index).sum()
print(f"TOTAL {float(total)}", flush=True)  # one write: other threads log to the same pipe
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env() -> dict[str, str]:
    """The test runner's environment minus anything a launcher would have set."""
    prefixes = ("SLURM_", "OMPI_", "PMIX_", "LSB_", "LSF_", "JSM_", "TORCHELASTIC_", "JAX_COORDINATOR")
    names = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes) and k not in names}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH")]))
    env.pop("XLA_FLAGS", None)
    return env


def start(port: int, n: int, i: int, timeout: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", INIT, f"127.0.0.1:{port}", str(n), str(i), str(timeout)],
        env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def finish(proc: subprocess.Popen, limit: float = 120) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"process hung for {limit} s:\n{out}")
    return proc.returncode, out


def test_process_without_coordinator_fails_with_a_sentence():
    t0 = time.monotonic()
    rc, out = finish(start(free_port(), 2, 1, 2))
    assert rc == 2, out
    assert "could not join the coordinator 127.0.0.1:" in out
    assert "Check failure stack trace" not in out
    assert time.monotonic() - t0 < 60


def test_coordinator_alone_fails_with_a_sentence():
    rc, out = finish(start(free_port(), 2, 0, 2))
    assert rc == 2, out
    assert "process 0 waited 2 s" in out and "not all 2 processes connected" in out


@pytest.mark.slow
def test_two_processes_meet_and_log_one_line_each():
    port = free_port()
    procs = [start(port, 2, i, 60) for i in range(2)]
    results = [finish(p) for p in procs]
    for i, (rc, out) in enumerate(results):
        assert rc == 0, out
        assert f"launcher=explicit process={i}/2 local_devices=2 local_device_ids=all global_devices=4 " \
               f"coordinator=127.0.0.1:{port}" in out
        assert "TOTAL 6.0" in out  # (0+1) + (2+3): every process saw both processes' data


PREEMPT = """
import os, signal, sys, time
from jaxrat.cluster import initialize, preemption_requested
initialize(None)
for step in range(1, 10_000):
    if step == 5:
        os.kill(os.getpid(), signal.SIGTERM)  # what the job script sends before the time limit
    if preemption_requested(step):
        print("STOP", step, flush=True)
        sys.exit(0)
    time.sleep(0.01)
"""


def test_single_process_preemption_stops_at_the_next_step():
    proc = subprocess.run([sys.executable, "-c", PREEMPT], env=clean_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["STOP", "5"]
