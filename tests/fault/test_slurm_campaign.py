"""A bounded fault campaign for a sweep run as a SLURM job array on the tests' own cluster (see
tests/fault/test_slurm.py): one element's training killed with -9 at random points, twice (in its first
run and in its rerun after the job requeued itself); the sweep command run again until it submits
nothing; the summary then equals an undisturbed local sweep's, exactly (the runs are deterministic
and resume bit for bit). The local sweep's campaign is tests/fault/test_fault_campaign.py.

The points are drawn from ``JAXRAT_FAULT_SEED`` (default 0), so a failure can be replayed.
"""

from __future__ import annotations

import csv
import json
import os
import random
import re
import subprocess
import sys
import time

import pytest

from jaxrat.checkpointing.store import committed_steps
from runner import env_with_devices
from test_slurm import JOB_NAME, REPO, job_field, run, slurm, step_pids, wait_for  # noqa: F401 (the fixture)

pytestmark = [pytest.mark.slow, pytest.mark.integration]

TOY = str(REPO / "tests" / "toy" / "sweep_config.py")  # base, lr_high, wide: the smoke config, eval and save every 2
COMMON = ["--config.num_train_steps=16"]  # long enough to be killed in the middle
COLUMNS = ("run", "state", "step", "eval step", "eval/dice", "eval/iou", "eval/loss")


def _table(root: str) -> list[tuple]:
    with open(os.path.join(root, "summary.csv")) as f:
        return [tuple(r.get(c) for c in COLUMNS) for r in csv.DictReader(f)]


def _release_when_requeued(element: str, restarts: int, log: str) -> None:
    """Wait for the element to end its run (completed, or requeued after its ``restarts``-th
    failure); a requeued job is held ~2 min: release it (not in the second of the requeue)."""
    wait_for(lambda: job_field(element, "JobState") == "COMPLETED" or
             (job_field(element, "Restarts") == str(restarts) and job_field(element, "JobState") == "PENDING"),
             300, f"{element} to complete or requeue", log)
    if job_field(element, "JobState") == "PENDING":
        time.sleep(3)
        subprocess.run(["scontrol", "update", f"JobId={job_field(element, 'JobId')}", "StartTime=now"], check=True,
                       timeout=30)


def test_a_sweep_array_killed_at_random_points_ends_with_the_undisturbed_table(slurm, tmp_path):
    rng = random.Random(int(os.environ.get("JAXRAT_FAULT_SEED", "0")))
    ref, root = str(tmp_path / "undisturbed"), tmp_path / "array"
    reference = subprocess.Popen([sys.executable, "-m", "jaxrat.sweep", "--config", TOY, "--root", ref, "--local",
                                  *COMMON], cwd=REPO, env=env_with_devices(1), stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)
    cmd = [sys.executable, "-m", "jaxrat.sweep", "--config", TOY, "--root", str(root), "--slurm", "--job-name",
           JOB_NAME, "--time", "00:15:00", *COMMON]
    try:
        proc = run(cmd, 60, JAX_NUM_CPU_DEVICES="1")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        job = re.search(r"submitted job (\d+)", proc.stdout).group(1)
        assert "#SBATCH --array=0-2\n" in (root / "sweep.sbatch").read_text()
        victim = rng.randrange(3)
        name = json.loads((root / "sweep.json").read_text())["variants"][victim]["name"]
        checkpoints = str(root / name / "checkpoints")
        element, log = f"{job}_{victim}", str(root / f"slurm-{job}_{victim}.out")
        landed, seen = 0, set()
        for restart in (1, 2):  # kill -9 its training anywhere: start-up, a step, an eval, a save
            wait_for(lambda: job_field(element, "JobState") in ("RUNNING", "COMPLETED"), 300, f"{element} to run")
            jobid = job_field(element, "JobId")
            wait_for(lambda: set(step_pids(jobid).values()) - seen or job_field(element, "JobState") == "COMPLETED",
                     300, f"the training of {element}", root / f"slurm-{job}_{victim}.out")
            pid = step_pids(jobid).get(0)
            if pid is None or pid in seen:
                break  # it finished before it could be killed
            seen.add(pid)
            if rng.random() < 0.7:  # mostly after this run's first new checkpoint: mid-training
                saved = committed_steps(checkpoints)[-1:]
                wait_for(lambda: committed_steps(checkpoints)[-1:] != saved or not os.path.exists(f"/proc/{pid}"), 300,
                         f"a checkpoint of {element}", log)
                time.sleep(rng.uniform(0.0, 1.0))
            else:  # anywhere in its start-up
                time.sleep(rng.uniform(0.0, 5.0))
            try:
                os.kill(pid, 9)
                landed += 1
            except ProcessLookupError:
                pass
            _release_when_requeued(element, landed, log)
        assert landed, "no kill landed: the training ended first"
        for _ in range(3):  # the same command until every variant is finished
            for i in range(3):
                wait_for(lambda: job_field(f"{job}_{i}", "JobState") in ("COMPLETED", "FAILED", "CANCELLED"), 420,
                         f"array element {i} to end", root / f"slurm-{job}_{i}.out")
            proc = run(cmd, 60, JAX_NUM_CPU_DEVICES="1")
            assert proc.returncode == 0, proc.stdout + proc.stderr
            if "all 3 variants are finished" in proc.stderr:
                break
            job = re.search(r"submitted job (\d+)", proc.stdout).group(1)
        else:
            pytest.fail(f"the sweep was still unfinished after three reruns: {proc.stderr}")
        assert reference.wait(600) == 0
    finally:
        if reference.poll() is None:
            reference.kill()
            reference.wait()
    text = open(log).read()
    assert text.count("jaxrat: training step ended with status 137") == landed, text[-3000:]
    proc = run([sys.executable, "-m", "jaxrat.summarize", str(root)], 120)
    assert proc.returncode == 0, proc.stderr
    assert _table(str(root)) == _table(ref)
    assert all(row[1] == "finished" for row in _table(str(root)))
