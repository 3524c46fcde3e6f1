"""Chaos: kill -9 (mid-save too), a killed peer of a two-process run, damaged checkpoints and a full
disk, in a loop; then the run finishes, and its per-step losses equal an uninterrupted run's while
the dataset it read is byte for byte what it was.

Every run has two devices, one process with two simulated devices or two processes with one each,
so the reductions add the same two numbers whichever way the run is cut (a sum of two is exact in
any order), and the losses can match the uninterrupted run's to 1e-6. The workdir lives on a small
tmpfs so the disk can really fill up. The loop runs every kind of
fault at least once and then random ones until ``JAXRAT_CHAOS_SECONDS`` (default 30: each CI run draws a
new seed, so the random part adds up over runs; set it higher for a long campaign) are spent; every
process has its own timeout.
"""

from __future__ import annotations

import glob
import os
import random
import signal
import socket
import subprocess
import time

import pytest

from jaxrat.checkpointing.store import committed_steps
from jaxrat.cluster import PREEMPTED_EXIT_CODE
from jaxrat.data.synthetic import isic as synthetic_isic
from runner import REPO, fill_disk, losses_by_step, main_cmd
from test_data_readonly import snapshot
from test_preempt import Run, cached_env, compile_cache, train_steps_logged, wait_until  # noqa: F401

pytestmark = pytest.mark.slow

BUDGET_S = float(os.environ.get("JAXRAT_CHAOS_SECONDS", "30"))
STEPS = 40
PEER_TIMEOUT = 15
BASE = [f"--config.num_train_steps={STEPS}", "--config.train.eval_every=100000", "--config.train.eval_at_end=false",
        "--config.checkpoint.best_metric=", "--config.train.log_every=1",
        f"--config.distributed.heartbeat_timeout={PEER_TIMEOUT}"]
CHAOS = [*BASE, "--config.checkpoint.every_steps=1", "--config.checkpoint.keep=3"]
QUIET = [*BASE, "--config.checkpoint.every_steps=1000"]
FAULTS = ("kill -9", "kill -9 mid-save", "damaged newest checkpoint", "kill one of two processes", "disk full")


def _mount_tmpfs(path: str, size_mb: int) -> bool:
    os.makedirs(path, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", path],
                          capture_output=True).returncode == 0


def _tmp_saves(ckdir: str) -> list[str]:
    return glob.glob(os.path.join(ckdir, "*.orbax-checkpoint-tmp*"))


def _start_two(workdir: str, args: list[str], cache: str, logs: list[str]) -> list[subprocess.Popen]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for i, log in enumerate(logs):
        cmd = main_cmd(workdir, *args, f"--config.distributed.coordinator_address=127.0.0.1:{port}",
                       "--config.distributed.num_processes=2", f"--config.distributed.process_id={i}")
        with open(log, "w") as f:
            procs.append(subprocess.Popen(cmd, cwd=REPO, env=cached_env(1, cache), stdout=f, stderr=subprocess.STDOUT))
    return procs


def _end(procs: list[subprocess.Popen], timeout: float) -> list[int | None]:
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=timeout))
        except subprocess.TimeoutExpired:
            codes.append(None)
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(30)
    return codes


def _damage_newest(ckdir: str) -> int | None:
    steps = committed_steps(ckdir)
    if len(steps) < 2:
        return None
    for path in glob.glob(os.path.join(ckdir, str(steps[-1]), "state", "**", "*"), recursive=True):
        if os.path.isfile(path) and os.path.getsize(path) > 0:
            with open(path, "r+b") as f:
                f.truncate(os.path.getsize(path) // 2)
    return steps[-1]


def test_chaos_ends_in_the_uninterrupted_run_and_leaves_the_dataset_alone(tmp_path, compile_cache):
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    dataset = str(tmp_path / "dataset")
    synthetic_isic.write_dataset(dataset, num_train=32, num_val=8, image_size=32, seed=5)
    os.remove(os.path.join(dataset, "jaxrat_synthetic.json"))  # a user's folder, not jaxrat's
    before = snapshot(dataset)
    data = [f"--config.data.data_dir={dataset}"]

    ref = str(tmp_path / "ref")
    run = Run(ref, [*QUIET, *data], cached_env(2, compile_cache), str(tmp_path / "ref.log"))
    assert run.wait() == 0, run.output()[-4000:]

    disk = str(tmp_path / "disk")
    can_fill = _mount_tmpfs(disk, 96)
    try:
        wd = os.path.join(disk, "run")
        ckdir = os.path.join(wd, "checkpoints")
        history: list[dict] = []
        start, finished = time.time(), False
        todo = [f for f in FAULTS if can_fill or f != "disk full"]
        while not finished and (todo or time.time() - start < BUDGET_S):
            fault = todo.pop(0) if todo else rng.choice([f for f in FAULTS if can_fill or f != "disk full"])
            logged = max(train_steps_logged(wd), default=0)
            context = f"seed {seed}, faults so far {history}, now {fault!r}"
            if fault == "damaged newest checkpoint":
                damaged = _damage_newest(ckdir)
                history.append({"fault": fault, "step": damaged})
                continue  # the next start must set it aside and resume from the one before
            if fault == "kill one of two processes":
                logs = [str(tmp_path / f"t{len(history)}_{i}.log") for i in range(2)]
                procs = _start_two(wd, [*CHAOS, *data], compile_cache, logs)
                try:
                    wait_until(lambda: max(train_steps_logged(wd), default=0) > logged or procs[0].poll() is not None,
                               [], what="a new train step")
                    if procs[0].poll() is None:
                        procs[1].send_signal(signal.SIGKILL)
                    t0 = time.time()
                    code = _end(procs[:1], PEER_TIMEOUT + 60)[0]
                    took = time.time() - t0
                finally:
                    _end(procs, 1)
                out = open(logs[0]).read()
                history.append({"fault": fault, "code": code, "took": round(took, 1)})
                finished = code == 0
                assert code in (0, PREEMPTED_EXIT_CODE), f"{context}\n{out[-3000:]}"
                assert code == 0 or took < PEER_TIMEOUT + 20, f"{context}: the survivor took {took:.0f} s"
                assert "Traceback" not in out, f"{context}\n{out[-3000:]}"
                continue
            run = Run(wd, [*CHAOS, *data], cached_env(2, compile_cache), str(tmp_path / f"t{len(history)}.log"))
            ballast = os.path.join(disk, "ballast")
            try:
                wait_until(lambda: max(train_steps_logged(wd), default=0) > logged or run.proc.poll() is not None,
                           [], what="a new train step")
                if fault == "kill -9":
                    time.sleep(rng.uniform(0.0, 1.0))
                    run.proc.send_signal(signal.SIGKILL)
                elif fault == "kill -9 mid-save":
                    deadline = time.time() + 10
                    while not _tmp_saves(ckdir) and run.proc.poll() is None and time.time() < deadline:
                        time.sleep(0.001)
                    run.proc.send_signal(signal.SIGKILL)
                elif fault == "disk full":
                    fill_disk(ballast)
                code = run.wait(180)
            finally:
                run.kill()
                if os.path.exists(ballast):
                    os.remove(ballast)
            out = run.output()
            history.append({"fault": fault, "code": code, "steps": committed_steps(ckdir)[-3:]})
            finished = code == 0
            assert "Traceback" not in out, f"{context}\n{out[-3000:]}"
            if fault == "disk full":
                assert code in (0, 2), f"{context}\n{out[-3000:]}"
                if code == 2:
                    last = out.strip().splitlines()[-1]
                    assert last.startswith("jaxrat: error:") and "space" in last.lower(), f"{context}\n{last}"
            else:
                assert code in (0, -signal.SIGKILL), f"{context}\n{out[-3000:]}"

        if not finished:
            run = Run(wd, [*QUIET, *data], cached_env(2, compile_cache), str(tmp_path / "final.log"))
            assert run.wait() == 0, f"seed {seed}: the final resume failed:\n{run.output()[-4000:]}"
        print(f"seed {seed}: {history}")
        damaged = [h for h in history if h["fault"] == "damaged newest checkpoint" and h["step"] is not None]
        if damaged:  # set aside, never deleted
            aside = [p for p in glob.glob(os.path.join(ckdir, "**", "*"), recursive=True) if "damaged" in p]
            assert aside, f"seed {seed}: no damaged checkpoint kept aside in {os.listdir(ckdir)}"
        a, b = losses_by_step(ref), losses_by_step(wd)
        assert sorted(a) == sorted(b) == list(range(1, STEPS + 1)), (seed, sorted(b))
        worst = max(abs(a[k] - b[k]) for k in a)
        assert worst <= 1e-6, f"seed {seed}: losses differ by {worst} from the uninterrupted run; {history}"
        assert snapshot(dataset) == before, f"seed {seed}: the dataset changed"
    finally:
        subprocess.run(["umount", "-l", disk], capture_output=True)
