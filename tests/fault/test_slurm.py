"""Against a real single-node SLURM cluster (Debian slurmctld/slurmd/munge, 4 fake GPUs) of the tests' own.

The fixture starts a private cluster with scripts/slurm_cluster.sh (``SLURM_CLUSTER_DIR``: its own
config, state, logs, munged and ports, in a fresh folder; ~10 s, more when the packages must be
installed) and stops and removes it after the module; every client command reaches it through
``SLURM_CONF``. It never submits to a cluster it merely finds answering (another one on this
machine, or a login node's production cluster): a user who wants these tests on an existing
cluster names its slurm.conf in ``JAXRAT_TEST_SLURM_CONF``. Only outside CI (CI=true), without root
or apt-get, are these tests skipped. Every srun/sbatch runs under a timeout and a Slurm time limit,
and leftover jobs of this session are cancelled by their name.
"""

from __future__ import annotations

import csv
import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from jaxrat.checkpointing.store import committed_steps
from runner import env_with_devices

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "scripts" / "slurm_cluster.sh"
JOB_NAME = f"jaxrat-pytest-{os.getpid()}"  # per session: teardown cancels only ours
OPT_IN = "JAXRAT_TEST_SLURM_CONF"  # the slurm.conf of an existing cluster to run these tests on, by choice


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _free_port_pair() -> int:
    """A port P with P and P + 1 free (slurmctld's and slurmd's)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port >= 65535:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports")


def _unavailable(why: str) -> None:
    if in_ci():
        pytest.fail(f"CI must run the SLURM tests, but {why}.")
    pytest.skip(why)


@pytest.fixture(scope="module")
def slurm():
    """A cluster of this module's own, started here and stopped and removed after it; or the
    cluster a user names in JAXRAT_TEST_SLURM_CONF."""
    previous = os.environ.get("SLURM_CONF")
    named = os.environ.get(OPT_IN, "")
    private, env = "", {}
    if named:
        os.environ["SLURM_CONF"] = named
        works = shutil.which("srun") and subprocess.run(["srun", "-N1", "-n1", "true"], capture_output=True,
                                                         timeout=60).returncode == 0
        if not works:
            pytest.fail(f"{OPT_IN}={named}: srun does not work on that cluster.")
    else:
        if os.geteuid() != 0:
            _unavailable("starting a private SLURM cluster needs root (or name a cluster in "
                         f"{OPT_IN}=/path/to/slurm.conf)")
        if not shutil.which("apt-get") and not shutil.which("slurmctld"):
            _unavailable("Slurm is not installed and there is no apt-get to install it")
        private = tempfile.mkdtemp(prefix="jaxrat-slurm-", dir="/tmp")  # short: munge's socket path is limited
        env = {**os.environ, "SLURM_CLUSTER_DIR": private, "SLURM_CLUSTER_PORT": str(_free_port_pair())}
        up = subprocess.run(["bash", str(CLUSTER), "up"], capture_output=True, text=True, timeout=600, env=env)
        if up.returncode != 0:
            subprocess.run(["bash", str(CLUSTER), "down", "--purge"], capture_output=True, timeout=120, env=env)
            _unavailable(f"scripts/slurm_cluster.sh up failed: {up.stderr.strip()[-2000:]}")
        os.environ["SLURM_CONF"] = os.path.join(private, "etc", "slurm.conf")
    try:
        yield
    finally:
        subprocess.run(["scancel", f"--name={JOB_NAME}", f"--user={os.getuid()}"], capture_output=True, timeout=30)
        if private:
            subprocess.run(["bash", str(CLUSTER), "down", "--purge"], capture_output=True, timeout=120, env=env)
        if previous is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = previous


def task_env(**extra: str) -> dict[str, str]:
    """The caller's environment without launcher variables (srun exports it to the tasks). XLA_FLAGS
    goes (the tasks' device count is JAX_NUM_CPU_DEVICES), less the suite's LLVM level
    (JAXRAT_TEST_XLA_FLAGS, tests/conftest.py): the jobs compile as every other training run of the
    suite does, in half the CPU, and their programs are the test run's cache entries."""
    drop = ("SLURM_", "OMPI_", "PMIX_", "LSB_", "TORCHELASTIC_", "JAX_COORDINATOR", "XLA_FLAGS")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop) or k == "SLURM_CONF"}
    if os.environ.get("JAXRAT_TEST_XLA_FLAGS"):
        env["XLA_FLAGS"] = os.environ["JAXRAT_TEST_XLA_FLAGS"]
    env.update(PYTHONUNBUFFERED="1", JAX_PLATFORMS="cpu", **extra)
    return env


def run(cmd: list[str], timeout: float, **env: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=task_env(**env), cwd=REPO)
    except subprocess.TimeoutExpired as err:
        subprocess.run(["scancel", f"--name={JOB_NAME}"], capture_output=True, timeout=30)
        pytest.fail(f"{' '.join(cmd[:6])} ... did not finish in {timeout} s:\n{err.stdout}\n{err.stderr}")


def srun(*args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    return run(["srun", f"--job-name={JOB_NAME}", "--time=5", "--kill-on-bad-exit=1", *args], timeout, **env)


def job_field(job: str, field: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, timeout=30).stdout
    m = re.search(rf"\b{field}=(\S+)", out)
    return m.group(1) if m else ""


def wait_for(predicate, timeout: float, what: str, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    tail = log.read_text()[-3000:] if log and log.exists() else ""
    pytest.fail(f"timed out after {timeout} s waiting for {what}\n{tail}")


WORLD = textwrap.dedent("""
    import logging
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from jaxrat.cluster import initialize
    info = initialize(None)
    import jax.numpy as jnp
    from jax.experimental import multihost_utils
    total = multihost_utils.process_allgather(jnp.ones(2) * (info.process_index + 1)).sum()
    # One write: the tasks run unbuffered, and print's pieces could interleave with the runtime's own output.
    import sys
    sys.stdout.write(f"RESULT {info.process_index} {info.process_count} {info.coordinator} {float(total)}\\n")
""")


def results(out: str) -> list[list[str]]:
    return sorted(list(m) for m in re.findall(r"RESULT (\d+) (\d+) (\S+) (\S+)\n", out))


def test_srun_two_tasks_find_each_other_and_split_fake_gpus(slurm):
    proc = srun("-n2", "--gpus-per-node=2", sys.executable, "-c", WORLD, JAX_NUM_CPU_DEVICES="2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = results(proc.stdout)
    assert [r[:2] for r in res] == [["0", "2"], ["1", "2"]]
    assert res[0][2] == res[1][2] and int(res[0][2].rsplit(":", 1)[1]) >= 61440
    assert all(float(r[3]) == 6.0 for r in res)  # 2*1 + 2*2 from both processes
    log = proc.stdout + proc.stderr
    # One task per GPU: each process was given its own (fake) GPU, 2 CPU devices each, 4 in all.
    assert "process=0/2 local_devices=2 local_device_ids=0 global_devices=4" in log
    assert "process=1/2 local_devices=2 local_device_ids=1 global_devices=4" in log


def test_srun_four_tasks_on_two_cores(slurm):
    proc = srun("-n4", sys.executable, "-c", WORLD, JAX_NUM_CPU_DEVICES="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [r[:2] for r in results(proc.stdout)] == [[str(i), "4"] for i in range(4)]


def test_two_concurrent_steps_in_one_allocation(slurm, tmp_path):
    script = tmp_path / "two_steps.sh"
    world = tmp_path / "world.py"
    world.write_text(WORLD)
    script.write_text(textwrap.dedent(f"""\
        #!/bin/bash
        srun -n2 --exact {sys.executable} {world} > {tmp_path}/a.out 2>&1 &
        srun -n2 --exact {sys.executable} {world} > {tmp_path}/b.out 2>&1 &
        wait %1 && wait %2
    """))
    proc = run(["sbatch", "--wait", f"--job-name={JOB_NAME}", "--time=5", "-n4", f"--output={tmp_path}/job.out",
                str(script)], 180, JAX_NUM_CPU_DEVICES="1")
    a, b = (results((tmp_path / f"{x}.out").read_text()) for x in "ab")
    assert proc.returncode == 0, (tmp_path / "a.out").read_text() + (tmp_path / "b.out").read_text()
    assert len(a) == len(b) == 2
    assert a[0][2] != b[0][2]  # same job id, different steps: different coordinator ports


def test_batch_script_without_srun_explains(slurm, tmp_path):
    proc = run(["sbatch", "--wait", f"--job-name={JOB_NAME}", "--time=5", "-n2", f"--output={tmp_path}/job.out",
                f"--wrap={sys.executable} -c 'from jaxrat.cluster import initialize; initialize(None)'"], 120)
    log = (tmp_path / "job.out").read_text()
    assert proc.returncode != 0
    assert "not inside a job step; start it with `srun python -m jaxrat.main ...`" in log


STUB_TRAIN = textwrap.dedent("""
    # A stand-in trainer that uses the same contract as jaxrat.main: cluster.initialize,
    # a collective per step, and cluster.preemption_requested (JAX's preemption sync point,
    # triggered by SIGTERM) to checkpoint and stop.
    import argparse, json, os, sys, time
    from pathlib import Path
    from jaxrat.cluster import initialize, preemption_requested
    p = argparse.ArgumentParser(); p.add_argument("--config"); p.add_argument("--workdir")
    args, _ = p.parse_known_args()
    info = initialize(None)
    import jax.numpy as jnp
    from jax.experimental import multihost_utils
    wd = Path(args.workdir); ckpt = wd / "ckpt.json"
    restart = os.environ.get("SLURM_RESTART_COUNT", "0")
    step = json.loads(ckpt.read_text())["step"] if ckpt.exists() else 0
    (wd / f"started-{info.process_index}-{restart}").write_text(str(step))
    target = step + 5 if restart != "0" else 10**9
    while step < target:
        step += 1
        multihost_utils.process_allgather(jnp.array(step))
        time.sleep(0.05)
        if preemption_requested(step):
            if info.process_index == 0:
                ckpt.write_text(json.dumps({"step": step}))
            print(f"preempted: checkpoint at step {step}", flush=True)
            sys.exit(0)
    if info.process_index == 0:
        (wd / "done.json").write_text(json.dumps({"step": step}))
""")


def test_launch_submit_preempt_requeue_resume(slurm, tmp_path):
    """The rendered sbatch script end to end: USR1 before the limit -> SIGTERM to the tasks -> JAX
    preemption sync point -> checkpoint -> requeue -> the rerun resumes from the checkpoint."""
    (tmp_path / "stub_train.py").write_text(STUB_TRAIN)
    workdir = tmp_path / "run"
    proc = run([sys.executable, "-m", "jaxrat.launch", "--config", "configs/isic.py:smoke", "--nodes", "1",
                "--tasks-per-node", "2", "--time", "00:10:00", "--job-name", JOB_NAME, "--workdir", str(workdir),
                "--module", "stub_train", "--setup", f"export PYTHONPATH={tmp_path}", "--submit",
                # this setup activates no environment, so the job's interpreter is named (else: PATH's)
                "--python", sys.executable], 60,
               JAX_NUM_CPU_DEVICES="1")
    assert proc.returncode == 0, proc.stderr
    job = re.search(r"submitted job (\d+)", proc.stdout).group(1)
    log = workdir / f"slurm-{job}.out"
    wait_for(lambda: all((workdir / f"started-{i}-0").exists() for i in range(2)), 120, "both tasks to start", log)
    time.sleep(1)
    # What Slurm does --signal-lead seconds before the time limit:
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], check=True, timeout=30)
    wait_for(lambda: job_field(job, "Restarts") == "1" and job_field(job, "JobState") == "PENDING", 120,
             "the job to requeue itself", log)
    saved = json.loads((workdir / "ckpt.json").read_text())["step"]
    assert saved > 0
    text = log.read_text()
    assert text.count("preempted: checkpoint at step") == 2 and "requeueing job" in text
    # A requeued job waits ~2 min before it is eligible again; make it eligible now, but not in
    # the same second as the requeue, or slurmd rejects the new start ("Job credential revoked").
    time.sleep(3)
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=True, timeout=30)
    wait_for(lambda: job_field(job, "JobState") == "COMPLETED", 120, "the requeued run to complete", log)
    assert (workdir / "started-0-1").read_text() == str(saved)  # resumed where the checkpoint was
    assert json.loads((workdir / "done.json").read_text())["step"] == saved + 5
    assert "restart 1" in log.read_text()


def test_srun_trains_the_smoke_config(slurm, tmp_path):
    """`srun -n2 python -m jaxrat.main --config configs/isic.py:smoke` trains and checkpoints."""
    workdir = tmp_path / "smoke"
    proc = srun("-n2", "--time=10", sys.executable, "-m", "jaxrat.main", "--config", "configs/isic.py:smoke",
                "--workdir", str(workdir), timeout=600, JAX_NUM_CPU_DEVICES="2")
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    for i in range(2):
        assert f"launcher=slurm process={i}/2 local_devices=2 local_device_ids=all global_devices=4" in log
    assert (workdir / "checkpoints" / "6").is_dir()
    steps = [json.loads(line)["step"] for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert max(steps) == 6


def test_launch_submit_runs_to_a_checkpoint(slurm, tmp_path):
    """`python -m jaxrat.launch ... --submit --wait`: one task per (fake) GPU, trains, checkpoints."""
    workdir = tmp_path / "job"
    proc = run([sys.executable, "-m", "jaxrat.launch", "--config", "configs/isic.py:smoke", "--nodes", "1",
                "--gpus-per-node", "2", "--time", "00:10:00", "--job-name", JOB_NAME, "--workdir", str(workdir),
                "--submit", "--wait", "--wait-timeout", "600"], 660, JAX_NUM_CPU_DEVICES="2")
    job = re.search(r"submitted job (\d+)", proc.stdout).group(1)
    log = (workdir / f"slurm-{job}.out").read_text()
    assert proc.returncode == 0, log[-4000:]
    assert "launcher=slurm process=0/2 local_devices=2 local_device_ids=0 global_devices=4" in log
    assert "launcher=slurm process=1/2 local_devices=2 local_device_ids=1 global_devices=4" in log
    assert (workdir / "checkpoints" / "6").is_dir()
    assert (workdir / f"{JOB_NAME}.sbatch").is_file()
    assert list((workdir.parent / "jax_cache").iterdir())  # the persistent compilation cache was used


DEAD_PEER_TIMEOUT = 15  # config.distributed.heartbeat_timeout of the job below
DEAD_PEER_STEPS = 40
DEAD_PEER_ARGS = [f"--config.num_train_steps={DEAD_PEER_STEPS}", "--config.checkpoint.every_steps=1",
                  "--config.train.log_every=1", "--config.train.eval_every=100000", "--config.train.eval_at_end=false",
                  "--config.checkpoint.best_metric=", f"--config.distributed.heartbeat_timeout={DEAD_PEER_TIMEOUT}"]


def step_pids(job: str) -> dict[int, int]:
    """Process index -> pid of the `python -m jaxrat.main` process of each task of the job's step 0."""
    out = subprocess.run(["scontrol", "listpids", job], capture_output=True, text=True, timeout=30).stdout
    pids = {}
    for line in out.splitlines()[1:]:
        pid, _, step, _, task = line.split()
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if step == "0" and task != "-" and b"jaxrat.main" in cmdline:
            pids[int(task)] = int(pid)
    return pids


def test_killed_tasks_requeue_the_job_and_the_reruns_resume_exactly(slurm, tmp_path):
    """The rendered sbatch script, one of its two tasks killed with -9 mid-run, twice in one job:
    process 1 first, then, in the rerun, process 0. Each time the survivor stops within the heartbeat
    timeout (naming the lost process; when process 0, the coordination service's host, is killed, JAX
    aborts the survivor at once), the job requeues itself (srun's status is 128+9, a failure within
    --max-restarts), and the last rerun's per-step losses equal an uninterrupted run's."""
    from runner import env_with_devices, losses_by_step, main_cmd
    from test_preempt import train_steps_logged

    # The reference (same global batch; losses do not depend on the process count) runs meanwhile. It
    # is read for its losses only, so it saves at its end alone: a save at each of its 40 steps cost
    # more CPU than its training (23-30 s against 10 s, measured), taken from the job beside it.
    ref = str(tmp_path / "reference")
    ref_args = [a for a in DEAD_PEER_ARGS if not a.startswith("--config.checkpoint.every_steps=")]
    reference = subprocess.Popen(main_cmd(ref, *ref_args, f"--config.checkpoint.every_steps={DEAD_PEER_STEPS}"),
                                 cwd=REPO, env=env_with_devices(2), stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)
    try:
        workdir = tmp_path / "run"
        # The test run's compilation cache (tests/conftest.py): the reruns compile nothing.
        proc = run([sys.executable, "-m", "jaxrat.launch", "--config", "configs/isic.py:smoke", "--tasks-per-node",
                    "2", "--time", "00:20:00", "--job-name", JOB_NAME, "--workdir", str(workdir), "--max-restarts",
                    "2", "--cache-dir", os.environ["JAX_COMPILATION_CACHE_DIR"], "--submit", "--", *DEAD_PEER_ARGS],
                   60, JAX_NUM_CPU_DEVICES="1")
        assert proc.returncode == 0, proc.stderr
        job = re.search(r"submitted job (\d+)", proc.stdout).group(1)
        log = workdir / f"slurm-{job}.out"
        last = 0
        for restart, victim in enumerate((1, 0), start=1):
            wait_for(lambda: max(train_steps_logged(str(workdir)), default=0) >= last + 4, 420,
                     f"4 train steps after step {last}", log)
            pids = step_pids(job)
            assert sorted(pids) == [0, 1], subprocess.run(["scontrol", "listpids", job], capture_output=True,
                                                          text=True).stdout
            survivor = 1 - victim
            os.kill(pids[victim], 9)
            killed = time.monotonic()
            wait_for(lambda: not Path(f"/proc/{pids[survivor]}").exists(), DEAD_PEER_TIMEOUT + 30,
                     f"the survivor of process {victim} to stop", log)
            took = time.monotonic() - killed
            assert took < DEAD_PEER_TIMEOUT + 15, f"the survivor of process {victim} took {took:.0f} s"
            last = max(train_steps_logged(str(workdir)))
            assert last < DEAD_PEER_STEPS, "the run finished before it could be killed"
            wait_for(lambda: job_field(job, "Restarts") == str(restart) and job_field(job, "JobState") == "PENDING",
                     60, f"the job to requeue itself a {restart}. time", log)
            text = log.read_text()
            if victim == 1:
                assert f"jaxrat: error: process 1 of 2 (host {os.uname().nodename}, pid {pids[1]})" in text, \
                    text[-3000:]
                assert "task 0: Exited with exit code 42" in text, text[-3000:]
            # srun's status is its tasks' highest: the killed task's 137, or 139 where the survivor of process
            # 0 (the coordination service's host) died of JAX's abort as a segfault (seen once in ~30 runs).
            ended = re.findall(r"jaxrat: training step ended with status (\d+)", text)
            allowed = ("137", "139") if victim == 0 else ("137",)
            assert len(ended) == restart and ended[:-1] == ["137"] * (restart - 1) and ended[-1] in allowed, \
                text[-3000:]
            assert f"jaxrat: requeue {restart} of at most 2 after a failure (--max-restarts)" in text, text[-3000:]
            # A requeued job is held ~2 min; release it, not in the same second as the requeue (see above).
            time.sleep(3)
            subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=True, timeout=30)
        wait_for(lambda: job_field(job, "JobState") == "COMPLETED", 420, "the requeued run to complete", log)
        text = log.read_text()
        assert "restart 2" in text and len(re.findall(r"resumed from step \d+", text)) >= 4, text[-3000:]
        assert reference.wait(timeout=420) == 0
    finally:
        if reference.poll() is None:
            reference.kill()
            reference.wait(30)
    got, want = losses_by_step(str(workdir)), losses_by_step(ref)
    assert sorted(got) == sorted(want) == list(range(1, DEAD_PEER_STEPS + 1))
    for step in want:
        assert abs(got[step] - want[step]) <= 1e-6, (step, got[step], want[step])


def test_config_error_ends_the_job_without_requeue(slurm, tmp_path):
    """Every task exits 2 on a config error; the rendered script must not requeue it (a rerun fails alike)."""
    workdir = tmp_path / "job"
    proc = run([sys.executable, "-m", "jaxrat.launch", "--config", "configs/isic.py:smoke", "--tasks-per-node", "2",
                "--time", "00:10:00", "--job-name", JOB_NAME, "--workdir", str(workdir), "--submit", "--wait",
                "--wait-timeout", "240", "--", "--config.no_such_key=1"], 300, JAX_NUM_CPU_DEVICES="1")
    job = re.search(r"submitted job (\d+)", proc.stdout).group(1)
    log = (workdir / f"slurm-{job}.out").read_text()
    assert proc.returncode == 2, log[-3000:]
    assert log.count("jaxrat: error: Unknown config key --config.no_such_key") == 2, log[-3000:]
    assert "jaxrat: training step ended with status 2," in log and "requeue" not in log, log[-3000:]
    assert job_field(job, "Restarts") == "0" and job_field(job, "JobState") == "FAILED"


ARRAY_SWEEP = textwrap.dedent("""
    # Three variants of the smoke config (tests/toy/sweep_config.py); "slow" runs long enough to be
    # killed after its first checkpoint.
    import sys
    sys.path.insert(0, {toy!r})
    from sweep_config import get_config  # noqa: F401
    def get_sweep(arg=None):
        return [("slow", ["--config.num_train_steps=200", "--config.checkpoint.every_steps=5",
                          "--config.train.eval_every=100"]),
                ("base", []),
                ("lr_high", ["--config.optimizer.learning_rate=0.01"])]
""")


def test_sweep_job_array_kill_one_element_and_resubmit(slurm, tmp_path):
    """`python -m jaxrat.sweep --slurm`: one array element per variant, each in its own workdir; one
    element cancelled after its first checkpoint; the same command again submits only that one, which
    resumes from its checkpoint; the summary then lists all three finished."""
    config = tmp_path / "sweep_config.py"
    config.write_text(ARRAY_SWEEP.format(toy=str(REPO / "tests" / "toy")))
    root = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "jaxrat.sweep", "--config", str(config), "--root", str(root), "--slurm",
           "--job-name", JOB_NAME, "--time", "00:15:00"]
    proc = run(cmd, 60, JAX_NUM_CPU_DEVICES="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job = re.search(r"submitted job (\d+)", proc.stdout).group(1)
    assert "#SBATCH --array=0-2\n" in (root / "sweep.sbatch").read_text()
    slow = root / "slow" / "checkpoints"
    wait_for(lambda: committed_steps(str(slow)), 420, "the first checkpoint of element 0",
             root / f"slurm-{job}_0.out")
    subprocess.run(["scancel", f"{job}_0"], check=True, timeout=30)
    for i in (1, 2):
        wait_for(lambda: job_field(f"{job}_{i}", "JobState") == "COMPLETED", 420, f"array element {i} to complete",
                 root / f"slurm-{job}_{i}.out")
    wait_for(lambda: job_field(f"{job}_0", "JobState") == "CANCELLED", 60, "element 0 to be cancelled")
    for name in ("base", "lr_high"):
        assert (root / name / "checkpoints" / "4" / "commit_success.txt").is_file()

    proc = run(cmd, 60, JAX_NUM_CPU_DEVICES="1")  # the same command: only the unfinished element goes
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "base: finished" in proc.stderr and "lr_high: finished" in proc.stderr
    killed_at = int(re.search(r"slow: at step (\d+) of 200, submitting", proc.stderr).group(1))
    assert 5 <= killed_at < 200
    again = re.search(r"submitted job (\d+)", proc.stdout).group(1)
    assert "#SBATCH --array=0\n" in (root / "sweep.sbatch").read_text()
    log = root / f"slurm-{again}_0.out"
    wait_for(lambda: job_field(f"{again}_0", "JobState") == "COMPLETED", 420, "the resubmitted element", log)
    assert f"resumed from step {killed_at}" in log.read_text(), log.read_text()[-3000:]
    assert committed_steps(str(slow))[-1] == 200

    proc = run([sys.executable, "-m", "jaxrat.summarize", str(root)], 60)
    assert proc.returncode == 0, proc.stderr
    for name in ("slow", "base", "lr_high"):
        assert re.search(rf"^\| {name} \| finished \| (200|4) \|", proc.stdout, re.M), proc.stdout


# A bounded fault campaign for a sweep run as a SLURM job array (in this module, so that it runs on the
# same cluster, after the tests above, rather than on a second cluster beside them that competes for the
# same two cores): one element's training killed with -9 at random points, twice (in its first run and in
# its rerun after the job requeued itself); the sweep command run again until it submits nothing; the
# summary then equals an undisturbed local sweep's, exactly (the runs are deterministic and resume bit for
# bit). The points are drawn from ``JAXRAT_FAULT_SEED`` (default 0), so a failure can be replayed. The
# local sweep's campaign is tests/fault/test_fault_campaign.py.

# base, lr_high, wide: the smoke config, eval and save every 2
SWEEP_TOY = str(REPO / "tests" / "toy" / "sweep_config.py")
CAMPAIGN_STEPS = ["--config.num_train_steps=16"]  # long enough to be killed in the middle
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
    reference = subprocess.Popen([sys.executable, "-m", "jaxrat.sweep", "--config", SWEEP_TOY, "--root", ref, "--local",
                                  *CAMPAIGN_STEPS], cwd=REPO, env=env_with_devices(1), stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)
    cmd = [sys.executable, "-m", "jaxrat.sweep", "--config", SWEEP_TOY, "--root", str(root), "--slurm", "--job-name",
           JOB_NAME, "--time", "00:15:00", *CAMPAIGN_STEPS]
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
