"""A process of a two-process run dies (kill -9) mid-training: the survivor stops within the configured
timeout, names the lost process in one sentence, and exits for requeue; the relaunch resumes from the last
checkpoint and finishes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from jaxrat.checkpointing import store
from jaxrat.cluster import PREEMPTED_EXIT_CODE
from runner import REPO, process_env
from test_preempt import compile_cache, train_steps_logged  # noqa: F401 (compile_cache is a fixture)

pytestmark = pytest.mark.slow

TIMEOUT = 15  # config.distributed.heartbeat_timeout in these runs
STEPS = 40
ARGS = [f"--config.num_train_steps={STEPS}", "--config.checkpoint.every_steps=2", "--config.train.log_every=1",
        "--config.train.eval_every=100000", "--config.train.eval_at_end=false", "--config.checkpoint.best_metric=",
        f"--config.distributed.heartbeat_timeout={TIMEOUT}"]


def start_two(workdir: str, logs: list[str], cache: str) -> list[subprocess.Popen]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for i in range(2):
        cmd = [sys.executable, "-m", "jaxrat.main", "--config=configs/isic.py:smoke", f"--workdir={workdir}", *ARGS,
               f"--config.distributed.coordinator_address=127.0.0.1:{port}", "--config.distributed.num_processes=2",
               f"--config.distributed.process_id={i}"]
        with open(logs[i], "w") as log:
            env = process_env(1)
            env.update(JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                       JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")  # the relaunch skips compilation
            procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs


def wait_for_steps(workdir: str, steps: int, procs: list[subprocess.Popen], logs: list[str]) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if len(train_steps_logged(workdir)) >= steps:
            return
        for p, log in zip(procs, logs):
            assert p.poll() is None, f"a process ended ({p.returncode}) before training:\n{open(log).read()[-4000:]}"
        time.sleep(0.05)
    raise AssertionError(f"no {steps} train steps within 300 s:\n{open(logs[0]).read()[-4000:]}")


def kill_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(30)


def stop(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    """Exit statuses, waiting at most ``timeout`` s for each; every process is gone afterwards."""
    try:
        return [p.wait(timeout=timeout) for p in procs]
    finally:
        kill_all(procs)


def test_survivor_of_a_killed_peer_exits_for_requeue_naming_it_and_the_relaunch_resumes(tmp_path, compile_cache):
    workdir, cache = str(tmp_path / "wd"), compile_cache
    logs = [str(tmp_path / f"{i}.log") for i in range(2)]
    procs = start_two(workdir, logs, cache)
    try:
        wait_for_steps(workdir, 5, procs, logs)  # saves every 2 steps: the kill may land mid-save
    except BaseException:
        kill_all(procs)
        raise
    procs[1].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    code = stop(procs[:1], TIMEOUT + 60)[0]
    took = time.monotonic() - killed
    kill_all(procs)
    out = open(logs[0]).read()
    assert code == PREEMPTED_EXIT_CODE, out[-4000:]
    assert took < TIMEOUT + 15, f"the survivor took {took:.1f} s"
    last = out.strip().splitlines()[-1]
    assert last.startswith("jaxrat: error: process 1 of 2 (host ") and f"pid {procs[1].pid})" in last, out[-4000:]
    assert "Traceback" not in out, out[-4000:]

    kept = store.committed_steps(os.path.join(workdir, "checkpoints"))
    assert kept and kept[-1] < STEPS
    relaunch = [str(tmp_path / f"again{i}.log") for i in range(2)]
    assert stop(start_two(workdir, relaunch, cache), 300) == [0, 0], open(relaunch[0]).read()[-4000:]
    assert f"resumed from step {kept[-1]}" in open(relaunch[0]).read()
    assert STEPS in train_steps_logged(workdir)


def test_when_process_0_dies_jax_ends_the_others_at_once(tmp_path, compile_cache):
    # Process 0 hosts JAX's coordination service, and JAX terminates every client that loses it
    # (status 134) before any watchdog could speak: bounded and non-zero, but not 42 (docs/cluster.md).
    workdir = str(tmp_path / "wd")
    logs = [str(tmp_path / f"{i}.log") for i in range(2)]
    procs = start_two(workdir, logs, compile_cache)
    try:
        wait_for_steps(workdir, 5, procs, logs)
    except BaseException:
        kill_all(procs)
        raise
    procs[0].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    code = stop(procs[1:], TIMEOUT + 60)[0]
    took = time.monotonic() - killed
    kill_all(procs)
    out = open(logs[1]).read()
    assert code != 0 and took < TIMEOUT + 15, (code, took, out[-4000:])
    assert ("Terminating process because the JAX distributed service detected fatal errors" in out
            or "jaxrat: error: process 0 of 2 (host " in out), out[-4000:]
