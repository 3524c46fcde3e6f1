"""Run ``python -m jaxrat.main`` in a subprocess with a chosen simulated device count."""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE = os.path.join(REPO, "configs", "isic.py") + ":smoke"


def env_with_devices(devices: int) -> dict[str, str]:
    """The current environment with ``devices`` simulated CPU devices and no launcher variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "PMIX_", "LSB_"))}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
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
