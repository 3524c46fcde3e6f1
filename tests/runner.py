"""Run ``python -m jaxrat.main`` in a subprocess with a chosen simulated device count."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE = os.path.join(REPO, "configs", "isic.py") + ":smoke"


def without_test_flags(xla_flags: str) -> str:
    """``xla_flags`` less the suite's JAXRAT_TEST_XLA_FLAGS (tests/conftest.py): for a program that must be
    compiled as users compile it."""
    test_flags = os.environ.get("JAXRAT_TEST_XLA_FLAGS", "")
    return xla_flags.replace(test_flags, "").strip() if test_flags else xla_flags


def env_with_devices(devices: int) -> dict[str, str]:
    """The current environment with ``devices`` simulated CPU devices and no launcher variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "PMIX_", "LSB_"))}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices} {os.environ.get('JAXRAT_TEST_XLA_FLAGS', '')}"
    env["JAX_PLATFORMS"] = "cpu"
    return env


def main_cmd(workdir: str, *overrides: str, config: str = SMOKE) -> list[str]:
    """Command line for one training run."""
    return [sys.executable, "-m", "jaxrat.main", f"--config={config}", f"--workdir={workdir}", *overrides]


def run_main(workdir: str, *overrides: str, devices: int = 1, config: str = SMOKE, timeout: int = 300,
             check: bool = True) -> subprocess.CompletedProcess:
    """Run a training to completion; raise with its output on failure when ``check``."""
    proc = subprocess.run(
        main_cmd(workdir, *overrides, config=config), env=env_with_devices(devices), cwd=REPO,
        capture_output=True, text=True, timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"jaxrat.main failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def read_metrics(workdir: str) -> list[dict]:
    """All lines of metrics.jsonl."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def losses_by_step(workdir: str, key: str = "train/loss") -> dict[int, float]:
    """Last logged value of ``key`` per step (a resumed run re-logs the steps after its checkpoint)."""
    out: dict[int, float] = {}
    for row in read_metrics(workdir):
        if key in row:
            out[row["step"]] = row[key]
    return out


def kill_when_ready(cmd: list[str], ready: str, what: str, timeout: float = 60.0) -> None:
    """Start ``cmd``, wait until it creates the file ``ready`` (the moment to interrupt it), then kill -9 it."""
    import time

    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not os.path.exists(ready) and proc.poll() is None:
            time.sleep(0.1)
        assert os.path.exists(ready), f"{what} never started"
    finally:
        proc.kill()
        proc.wait(timeout=30)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(devices: int) -> dict[str, str]:
    """Environment of one process of a multi-process run: ``devices`` CPU devices, no launcher variables.
    XLA_FLAGS is the suite's LLVM level alone (JAXRAT_TEST_XLA_FLAGS, tests/conftest.py; the device count
    is JAX_NUM_CPU_DEVICES here), as in every single-process run the tests start: without it each
    process compiled at -O2 (a 2-process smoke run: 83 s of CPU against 31 s, the same losses)."""
    drop = ("SLURM_", "OMPI_", "PMIX_", "LSB_", "LSF_", "JSM_", "TORCHELASTIC_", "JAX_COORDINATOR", "XLA_FLAGS")
    names = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop) and k not in names}
    if os.environ.get("JAXRAT_TEST_XLA_FLAGS"):
        env["XLA_FLAGS"] = os.environ["JAXRAT_TEST_XLA_FLAGS"]
    env.update(JAX_NUM_CPU_DEVICES=str(devices), JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    return env


def run_processes(workdir: Path, processes: int, devices: int, args: list[str], config: str = SMOKE,
                  timeout: int = 600) -> list[str]:
    """Run jaxrat.main in ``processes`` processes on 127.0.0.1 sharing ``devices`` CPU devices (explicit
    coordinator flags); assert every one exits 0 and return their logs."""
    port = free_port()
    procs = []
    for i in range(processes):
        cmd = [sys.executable, "-m", "jaxrat.main", "--config", config, "--workdir", str(workdir), *args]
        if processes > 1:
            cmd += [f"--config.distributed.coordinator_address=127.0.0.1:{port}",
                    f"--config.distributed.num_processes={processes}", f"--config.distributed.process_id={i}"]
        log = open(workdir.parent / f"{workdir.name}-{i}.log", "w+")
        env = process_env(devices // processes)
        procs.append((subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    logs = []
    try:
        for proc, log in procs:
            proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.seek(0)
            logs.append(log.read())
            log.close()
    for i, ((proc, _), text) in enumerate(zip(procs, logs)):
        assert proc.returncode == 0, f"process {i}/{processes} exited {proc.returncode}:\n{text[-4000:]}"
    return logs


def assert_same_losses(a: dict[int, float], b: dict[int, float], *, rtol: float = 0.0, atol: float = 0.0,
                       what: str = "") -> float:
    """Same steps, and the values at each equal within the tolerances; returns the largest difference."""
    assert sorted(a) == sorted(b) and a, (what, sorted(a), sorted(b))
    x, y = np.array([a[k] for k in sorted(a)]), np.array([b[k] for k in sorted(b)])
    np.testing.assert_allclose(y, x, rtol=rtol, atol=atol, err_msg=what)
    return float(np.abs(x - y).max())


def fill_disk(path: str) -> None:
    """Write a ballast file at ``path`` until not one more byte fits on its filesystem."""
    with open(path, "wb", buffering=0) as f:
        for chunk in (1 << 20, 1 << 12, 1):
            try:
                while True:
                    f.write(b"\0" * chunk)
            except OSError:
                pass
