"""Preemption end to end: SIGUSR1/SIGTERM (also mid-evaluation, also twice) save, exit 42, resume.

Each training runs in its own subprocess (``python -m jaxrat.main``); every wait is bounded.
"""

import json
import os
import re
import signal
import subprocess
import time

import numpy as np
import pytest

from jaxrat.checkpointing import store
from jaxrat.cluster import PREEMPTED_EXIT_CODE
from jaxrat.experiments.summary import read_metrics
from runner import REPO, SMOKE, env_with_devices, losses_by_step, main_cmd, without_test_flags

REQUEUE = PREEMPTED_EXIT_CODE  # what launch/*.sbatch requeue on
TIMEOUT = 240


@pytest.fixture(scope="session")
def compile_cache(tmp_path_factory) -> str:
    """The test run's one persistent XLA compilation cache (tests/conftest.py) for the relaunches (JAX
    writes it from process 0 only, so two-process runs may share it)."""
    return os.environ["JAX_COMPILATION_CACHE_DIR"]


def cached_env(devices: int, cache_dir: str) -> dict[str, str]:
    """Simulated devices plus a persistent compilation cache: relaunches skip XLA compilation."""
    env = env_with_devices(devices)
    env.update(JAX_COMPILATION_CACHE_DIR=cache_dir, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")
    return env


class Run:
    """One ``jaxrat.main`` process with its output in a file."""

    def __init__(self, workdir: str, args: list[str], env: dict[str, str], log: str, config: str = SMOKE):
        self.log_path = log
        self._log = open(log, "w")
        self.proc = subprocess.Popen(main_cmd(workdir, *args, config=config), env=env, cwd=REPO, stdout=self._log,
                                     stderr=subprocess.STDOUT)

    def wait(self, timeout: float = TIMEOUT) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
            raise AssertionError(f"run did not end within {timeout} s:\n{self.output()[-4000:]}")
        finally:
            self._log.close()

    def output(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
        self._log.close()


def wait_until(cond, runs, timeout: float = TIMEOUT, what: str = "") -> None:
    """Poll ``cond`` every 5 ms; fail if it takes too long or a run ends first."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return
        for r in runs:
            if r.proc.poll() is not None:
                raise AssertionError(f"run ended ({r.proc.returncode}) before {what}:\n{r.output()[-4000:]}")
        time.sleep(0.005)
    raise AssertionError(f"timed out waiting for {what}")


def train_steps_logged(workdir: str) -> set[int]:
    """Steps with a train line in metrics.jsonl so far (a line being written is skipped)."""
    path = os.path.join(workdir, "metrics.jsonl")
    return {row["step"] for row in read_metrics(path) if "train/loss" in row} if os.path.exists(path) else set()


def save_started(directory: str, step: int) -> bool:
    if not os.path.isdir(directory):
        return False
    return any(n == str(step) or n.startswith(f"{step}.orbax-checkpoint-tmp") for n in os.listdir(directory))


def preempted_step(output: str) -> int:
    m = re.search(r"preempted (?:during evaluation )?at step (\d+)", output)
    assert m, output[-4000:]
    return int(m.group(1))


def assert_same_run(ref: str, wd: str) -> None:
    """Per-step train losses and data fingerprints, and every eval, equal the uninterrupted run's."""
    tolerances = {"train/loss": 1e-6, "train/foreground_fraction": 0.0, "eval/dice": 1e-6, "eval/loss": 1e-6}
    for key, atol in tolerances.items():
        a, b = losses_by_step(ref, key), losses_by_step(wd, key)
        assert sorted(a) == sorted(b) and a, (key, sorted(a), sorted(b))
        np.testing.assert_allclose([b[k] for k in sorted(b)], [a[k] for k in sorted(a)], rtol=0, atol=atol, err_msg=key)


# Eval every 20 of 40 steps over 400 validation images, so an evaluation lasts long enough to be hit.
ARGS = ["--config.num_train_steps=40", "--config.train.eval_every=20", "--config.checkpoint.every_steps=1000",
        "--config.data.synthetic_val=400", "--config.data.eval_batch_size=8"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, compile_cache):
    base = tmp_path_factory.mktemp("preempt")
    cache = compile_cache
    ref = str(base / "ref")
    run = Run(ref, ARGS, cached_env(1, cache), str(base / "ref.log"))
    assert run.wait() == 0, run.output()[-4000:]
    return base, cache, ref


def test_signals_save_exit_for_requeue_and_resume_exactly(reference, tmp_path):
    base, cache, ref = reference
    wd = str(tmp_path / "wd")
    ckdir = os.path.join(wd, "checkpoints")

    # 1. SIGUSR1 (SLURM's --signal warning) in the middle of training.
    run = Run(wd, ARGS, cached_env(1, cache), str(tmp_path / "1.log"))
    wait_until(lambda: len(train_steps_logged(wd)) >= 4, [run], what="4 train steps")
    run.proc.send_signal(signal.SIGUSR1)
    assert run.wait() == REQUEUE, run.output()[-4000:]
    first = preempted_step(run.output())
    assert 4 <= first < 20
    assert store.committed_steps(ckdir) == [first]
    meta = store.step_metadata(ckdir, first)
    assert meta["reason"] == "preemption" and meta["eval_pending"] is False
    summary = json.load(open(os.path.join(wd, "summary.json")))  # written on the way out, too
    assert summary["status"] == "preempted" and summary["steps"]["last"] == first
    assert summary["checkpoints"]["last"] == os.path.join(ckdir, str(first))

    # 2. SIGTERM while evaluating at step 20, and a second SIGTERM once the save has started.
    run = Run(wd, ARGS, cached_env(1, cache), str(tmp_path / "2.log"))
    wait_until(lambda: 20 in train_steps_logged(wd), [run], what="step 20 (then its evaluation)")
    run.proc.send_signal(signal.SIGTERM)
    wait_until(lambda: save_started(ckdir, 20) or run.proc.poll() is not None, [], what="the preemption save")
    if run.proc.poll() is None:
        run.proc.send_signal(signal.SIGTERM)
    assert run.wait() == REQUEUE, run.output()[-4000:]
    out = run.output()
    assert f"resumed from step {first}" in out
    assert "preempted during evaluation at step 20" in out, out[-3000:]
    assert store.committed_steps(ckdir) == [first, 20]
    assert store.step_metadata(ckdir, 20)["eval_pending"] is True
    assert 20 not in losses_by_step(wd, "eval/dice")  # the cut evaluation wrote nothing

    # 3. Relaunch: the interrupted evaluation runs first, then training continues to the end.
    run = Run(wd, ARGS, cached_env(1, cache), str(tmp_path / "3.log"))
    assert run.wait() == 0, run.output()[-4000:]
    out = run.output()
    assert "resumed from step 20" in out and "eval step 20:" in out
    summary = json.load(open(os.path.join(wd, "summary.json")))
    assert summary["status"] == "finished" and summary["steps"]["first"] == 20
    assert summary["steps"]["last"] == summary["steps"]["total"]
    assert_same_run(ref, wd)


def test_init_from_best_starts_a_new_run_and_a_shape_mismatch_names_the_parameter(reference, tmp_path):
    base, cache, ref = reference
    best, pointer = store.best_step(os.path.join(ref, "checkpoints"))
    assert pointer["metric"] == "eval/dice" and best in (20, 40)
    args = [*ARGS, f"--config.init_from={ref}:best"]  # same shapes and schedule: compiled code is cached
    run = Run(str(tmp_path / "new"), args, cached_env(1, cache), str(tmp_path / "new.log"))
    assert run.wait() == 0, run.output()[-4000:]
    assert f"init_from: loaded params from {ref}/checkpoints/{best}" in run.output()
    # Trained weights (fresh optimizer, same data): the first loss is far below a fresh model's.
    assert losses_by_step(str(tmp_path / "new"))[1] < losses_by_step(ref)[1] - 0.05

    run = Run(str(tmp_path / "bad"), [*args, "--config.model.num_classes=2", "--config.init_from_strict=true"],
              cached_env(1, cache),
              str(tmp_path / "bad.log"))
    assert run.wait() == 2
    err = run.output().strip().splitlines()[-1]
    assert err.startswith("jaxrat: error: init_from: params/") and "in this model" in err, err


def test_ctrl_c_saves_at_the_next_step_and_a_second_one_exits_at_once(tmp_path, compile_cache):
    """Ctrl-C while a checkpoint is being written: honoured after that save, at the next step
    boundary, with a checkpoint, status 130, one closing line and no traceback; twice: out at once."""
    from jaxrat.cluster import INTERRUPTED_EXIT_CODE

    wd = str(tmp_path / "wd")
    ckdir = os.path.join(wd, "checkpoints")
    args = ["--config.num_train_steps=400", "--config.checkpoint.every_steps=1", "--config.train.eval_every=1000"]
    run = Run(wd, args, cached_env(1, compile_cache), str(tmp_path / "1.log"))
    wait_until(lambda: save_started(ckdir, 3), [run], what="the save of step 3")
    run.proc.send_signal(signal.SIGINT)
    assert run.wait() == INTERRUPTED_EXIT_CODE == 130, run.output()[-4000:]
    out = run.output()
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-4000:]
    m = re.search(r"jaxrat: interrupted at step (\d+); run the same command to resume\n$", out)
    assert m, out[-3000:]
    step = int(m.group(1))
    assert step >= 3 and store.committed_steps(ckdir)[-1] == step
    assert store.step_metadata(ckdir, step)["reason"] == "preemption"
    assert json.load(open(os.path.join(wd, "summary.json")))["status"] == "interrupted"
    assert "Status: **interrupted**" in open(os.path.join(wd, "summary.md")).read()

    run = Run(wd, args, cached_env(1, compile_cache), str(tmp_path / "2.log"))
    wait_until(lambda: len(train_steps_logged(wd)) >= step + 2, [run], what="two steps after the resume")
    run.proc.send_signal(signal.SIGINT)
    wait_until(lambda: "Ctrl-C again exits now" in run.output(), [run], what="the first Ctrl-C's notice")
    run.proc.send_signal(signal.SIGINT)  # while it finishes the step and saves (seconds)
    assert run.wait(timeout=30) == -signal.SIGINT, run.output()[-4000:]  # a shell reports 130
    out = run.output()
    assert f"resumed from step {step}" in out and "Traceback" not in out, out[-4000:]
    assert "jaxrat: interrupted at step" not in out


def test_a_second_ctrl_c_during_start_up_ends_the_run_at_once_with_its_line_and_the_lock_released(tmp_path):
    """Two Ctrl-Cs while the first step compiles (in XLA, where Python runs no signal handler): the run
    ends within moments, status 130, start-up's closing line last and no traceback, run.lock released
    and config.json whole, the MLflow run ended as KILLED (not left RUNNING); the rerun starts without
    taking a lock over. (It died by the default action, leaving the lock and no line.)"""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    from jaxrat.cluster import INTERRUPTED_EXIT_CODE

    wd = str(tmp_path / "wd")
    # A U-Net whose step compiles for seconds, and no compilation cache, so the compile is never skipped;
    # MLflow in the workdir's own database.
    args = ["--config.num_train_steps=2", "--config.train.compilation_cache_dir=none",
            "--config.model.features=(16,32,64,128)", "--config.data.image_size=64",
            "--config.tracking.backends=('jsonl','mlflow')"]
    env = env_with_devices(1)
    env["XLA_FLAGS"] = without_test_flags(env["XLA_FLAGS"])  # XLA's full compile: seconds, not the suite's fast one
    run = Run(wd, args, env, str(tmp_path / "1.log"))
    wait_until(lambda: "compiling the train step" in run.output(), [run], what="the first step's compile")
    run.proc.send_signal(signal.SIGINT)
    wait_until(lambda: "Ctrl-C again exits now" in run.output(), [run], what="the first Ctrl-C's notice")
    run.proc.send_signal(signal.SIGINT)
    assert run.wait(timeout=60) == INTERRUPTED_EXIT_CODE, run.output()[-4000:]
    out = run.output()
    assert "train step compiled" not in out, out[-3000:]  # it ended inside the compile, not after it
    assert re.search(r"\njaxrat: interrupted before step 1 \(during start-up, no checkpoint yet\); run the same "
                     r"command to resume\n$", out), out[-3000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    left = sorted(os.listdir(wd))
    assert not [n for n in left if n.startswith("run.lock") or n.endswith(".tmp")], left
    assert json.load(open(os.path.join(wd, "config.json")))["num_train_steps"] == 2
    assert store.committed_steps(os.path.join(wd, "checkpoints")) == []
    run_id = json.load(open(os.path.join(wd, "mlflow_run.json")))["run_id"]
    assert MlflowClient("sqlite:///" + os.path.join(wd, "mlflow.db")).get_run(run_id).info.status == "KILLED"

    run = Run(wd, ["--config.num_train_steps=0", *args[1:]], env, str(tmp_path / "2.log"))
    assert run.wait() == 0, run.output()[-4000:]
    assert "took over the workdir lock" not in run.output(), run.output()[-3000:]
    assert not os.path.exists(os.path.join(wd, "run.lock"))
