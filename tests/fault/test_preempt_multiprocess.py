"""Two real processes: SIGTERM to one of them, requeue exit, relaunch; and restores across topologies.

Two processes x 4 simulated devices (8 in all) against one process x 4 devices. ZeRO-3 over an
``fsdp`` axis of 2 shards parameters and optimizer state, so every cross-topology restore really
reshards. Resumed steps must see exactly the examples of the uninterrupted run: the per-step
foreground fraction (a sum of 0/1 mask pixels, exact in float32) must be equal, and the losses
equal up to the float reordering of another device count.
"""

import json
import os
import re
import shutil
import signal
import socket

import numpy as np
import pytest

from jaxrat.checkpointing import store
from runner import losses_by_step
from test_preempt import (  # noqa: F401 (compile_cache is a fixture)
    REQUEUE,
    Run,
    cached_env,
    compile_cache,
    preempted_step,
    train_steps_logged,
    wait_until,
)

STEPS = 40
# Saves every 20 steps (kept for good) and every 0.3 s (decided by process 0's clock for both).
ARGS = [f"--config.num_train_steps={STEPS}", "--config.checkpoint.every_steps=20", "--config.checkpoint.keep_every=20",
        "--config.checkpoint.every_minutes=0.005", "--config.checkpoint.best_metric=",
        "--config.train.eval_every=100000", "--config.train.eval_at_end=false",
        "--config.mesh.axes=(('data', -1), ('fsdp', 2))", "--config.sharding.zero=3", "--config.sharding.min_size=1"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_two(wd: str, log: str, cache: str) -> list[Run]:
    port = _free_port()
    return [Run(wd, [*ARGS, f"--config.distributed.coordinator_address=127.0.0.1:{port}",
                     "--config.distributed.num_processes=2", f"--config.distributed.process_id={i}",
                     "--config.distributed.heartbeat_timeout=20"], cached_env(4, cache), f"{log}.{i}")
            for i in range(2)]


def _finish(runs: list[Run]) -> tuple[list[int], list[str]]:
    try:
        codes = [r.wait() for r in runs]
    finally:
        for r in runs:
            r.kill()
    return codes, [r.output() for r in runs]


def _one(wd: str, log: str, cache: str) -> str:
    run = Run(wd, ARGS, cached_env(4, cache), log)
    assert run.wait() == 0, run.output()[-4000:]
    return run.output()


def _two(wd: str, log: str, cache: str) -> list[str]:
    codes, outs = _finish(_start_two(wd, log, cache))
    assert codes == [0, 0], "\n---\n".join(o[-3000:] for o in outs)
    return outs


def _copy_as_of(src: str, dst: str, step: int) -> None:
    """A copy of a run as if it had stopped right after saving ``step``."""
    shutil.copytree(src, dst)
    ckdir = os.path.join(dst, "checkpoints")
    for s in store.committed_steps(ckdir):
        if s > step:
            shutil.rmtree(os.path.join(ckdir, str(s)))
    path = os.path.join(dst, "metrics.jsonl")
    rows = [json.loads(line) for line in open(path)]
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows if r["step"] <= step)


def _assert_continues(ref: str, wd: str) -> None:
    assert {20, 40} <= set(store.committed_steps(os.path.join(wd, "checkpoints")))
    for key, rtol in (("train/foreground_fraction", 0.0), ("train/loss", 1e-5)):
        a, b = losses_by_step(ref, key), losses_by_step(wd, key)
        assert sorted(a) == sorted(b) == list(range(1, STEPS + 1)), (key, sorted(b))
        np.testing.assert_allclose([b[k] for k in sorted(b)], [a[k] for k in sorted(a)], rtol=rtol, atol=0, err_msg=key)


@pytest.fixture(scope="module")
def ref(tmp_path_factory, compile_cache):
    """Uninterrupted: one process, four devices."""
    wd = str(tmp_path_factory.mktemp("ref") / "wd")
    _one(wd, wd + ".log", compile_cache)
    return wd


@pytest.fixture(scope="module")
def preempted(tmp_path_factory, compile_cache):
    """Two processes x four devices; SIGTERM to process 1 only, after a few steps."""
    base = tmp_path_factory.mktemp("preempted")
    wd = str(base / "wd")
    runs = _start_two(wd, str(base / "a.log"), compile_cache)
    try:
        wait_until(lambda: len(train_steps_logged(wd)) >= 3, runs, what="3 train steps")
        runs[1].proc.send_signal(signal.SIGTERM)
    finally:
        codes, outs = _finish(runs)
    snapshot = str(base / "snapshot")
    shutil.copytree(wd, snapshot)
    return base, wd, snapshot, codes, outs


def test_sigterm_to_one_of_two_processes_saves_one_step_in_both_and_exits_for_requeue(preempted):
    _, wd, _, codes, outs = preempted
    assert codes == [REQUEUE, REQUEUE], "\n---\n".join(o[-3000:] for o in outs)
    steps = [preempted_step(o) for o in outs]
    assert steps[0] == steps[1] < STEPS
    ckdir = os.path.join(wd, "checkpoints")
    assert store.committed_steps(ckdir)[-1] == steps[0]
    assert store.step_metadata(ckdir, steps[0])["reason"] in ("preemption", "steps")
    assert sorted(os.listdir(os.path.join(ckdir, str(steps[0]), "data"))) == [
        "commit_success.txt", "process_0-of-2.json", "process_1-of-2.json"]


def test_relaunch_of_the_two_processes_resumes_exactly(preempted, ref, compile_cache):
    base, wd, _, codes, outs = preempted
    assert codes == [REQUEUE, REQUEUE]
    step = preempted_step(outs[0])
    outs = _two(wd, str(base / "b.log"), compile_cache)
    assert all(f"resumed from step {step} (iterator state)" in o for o in outs)
    # Both processes took the time-based saves at the same steps.
    timed = [re.findall(r"saving step (\d+) \(time\)", o) for o in outs]
    assert timed[0] == timed[1] and timed[0], timed
    _assert_continues(ref, wd)


def test_saved_by_two_processes_on_8_devices_resumed_by_one_on_4(preempted, ref, compile_cache):
    base, _, snapshot, codes, outs = preempted
    assert codes == [REQUEUE, REQUEUE]
    wd = str(base / "two_then_one")
    shutil.copytree(snapshot, wd)
    out = _one(wd, str(base / "c.log"), compile_cache)
    assert f"resumed from step {preempted_step(outs[0])} (position from step)" in out
    assert "over 4 devices in 1 processes" in out
    _assert_continues(ref, wd)


def test_saved_by_one_process_on_4_devices_resumed_by_two_on_8(ref, tmp_path, compile_cache):
    wd = str(tmp_path / "one_then_two")
    _copy_as_of(ref, wd, 20)
    outs = _two(wd, str(tmp_path / "d.log"), compile_cache)
    assert all("resumed from step 20 (position from step)" in o for o in outs)
    assert "over 8 devices in 2 processes" in outs[0]
    _assert_continues(ref, wd)
