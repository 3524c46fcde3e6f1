"""One run per workdir, end to end: a second ``jaxrat.main`` on a live workdir stops naming the
first; after kill -9 the next run takes over and resumes exactly; a changed config stops a resume.

The lock and config logic themselves are tested in-process in tests/unit/test_workdir.py.
"""

import dataclasses
import json
import os
import signal
import socket
import time

import pytest

from jaxrat.trainer.workdir_lock import LOCK_NAME, Holder
from runner import losses_by_step
from test_preempt import Run, cached_env, compile_cache, wait_until  # noqa: F401

STEPS = 60  # enough that the first run is still training when it is stopped after its first checkpoint
ARGS = [f"--config.num_train_steps={STEPS}", "--config.checkpoint.every_steps=5", "--config.train.eval_every=100000",
        "--config.checkpoint.best_metric="]


def _committed(workdir: str) -> list[int]:
    d = os.path.join(workdir, "checkpoints")
    return sorted(int(n) for n in os.listdir(d) if n.isdigit()) if os.path.isdir(d) else []


def _snapshot(workdir: str) -> dict[str, int]:
    return {os.path.join(r, n): os.stat(os.path.join(r, n)).st_size for r, _, ns in os.walk(workdir) for n in ns}


@pytest.mark.slow
def test_second_run_stops_naming_the_first_and_a_run_after_kill9_takes_over_exactly(tmp_path, compile_cache):
    env = cached_env(1, compile_cache)
    ref, wd = str(tmp_path / "ref"), str(tmp_path / "wd")
    run = Run(ref, ARGS, env, str(tmp_path / "ref.log"))  # also fills the compile cache
    assert run.wait() == 0, run.output()[-4000:]

    first = Run(wd, ARGS, env, str(tmp_path / "first.log"))
    try:
        wait_until(lambda: _committed(wd), [first], what="the first checkpoint")
        first.proc.send_signal(signal.SIGSTOP)  # alive but silent: holds the lock, writes nothing
        assert max(losses_by_step(wd)) < STEPS, "the first run finished before it could be stopped"
        before = _snapshot(wd)

        t0 = time.monotonic()
        second = Run(wd, ARGS, env, str(tmp_path / "second.log"))
        code, took = second.wait(120), time.monotonic() - t0
        out = second.output()
        print(f"second run stopped after {took:.1f} s")
        last = out.strip().splitlines()[-1]
        assert code == 2, out[-4000:]
        assert last.startswith(f"jaxrat: error: The workdir {wd} is in use by another run (process {first.proc.pid} "
                               f"on host {socket.gethostname()}, since "), last
        assert "Traceback" not in out and took < 60, (took, out[-4000:])
        assert _snapshot(wd) == before  # the second run wrote nothing

        first.proc.send_signal(signal.SIGKILL)
        assert first.wait(30) == -signal.SIGKILL
    finally:
        first.kill()
    resume_from = _committed(wd)[-1]
    assert json.load(open(os.path.join(wd, LOCK_NAME)))["pid"] == first.proc.pid  # left behind by kill -9

    third = Run(wd, ARGS, env, str(tmp_path / "third.log"))
    assert third.wait() == 0, third.output()[-4000:]
    out = third.output()
    assert f"took over the workdir lock {wd}/{LOCK_NAME} of process {first.proc.pid}" in out, out[-4000:]
    assert "its process is gone" in out and f"resumed from step {resume_from} " in out, out[-4000:]
    assert not os.path.exists(os.path.join(wd, LOCK_NAME))
    a, b = losses_by_step(ref), losses_by_step(wd)
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    assert max(abs(a[k] - b[k]) for k in a) <= 1e-6, {k: (a[k], b[k]) for k in a if abs(a[k] - b[k]) > 1e-6}


@pytest.mark.slow
def test_changed_config_stops_a_resume_and_a_stale_lock_from_another_host_is_taken_over(tmp_path, compile_cache):
    env = cached_env(1, compile_cache)
    wd = str(tmp_path / "wd")
    run = Run(wd, [], env, str(tmp_path / "1.log"))
    assert run.wait() == 0, run.output()[-4000:]

    # A run on another host died without releasing the lock: its lease expired long ago.
    gone = dataclasses.replace(Holder.this_process(), host="node-elsewhere", pid=4321)
    with open(os.path.join(wd, LOCK_NAME), "w") as f:
        json.dump(dataclasses.asdict(gone), f)
    os.utime(os.path.join(wd, LOCK_NAME), (time.time() - 3600,) * 2)

    run = Run(wd, ["--config.data.image_size=48"], env, str(tmp_path / "2.log"))
    assert run.wait() == 2, run.output()[-4000:]
    out = run.output()
    assert "took over the workdir lock" in out and "process 4321 on host node-elsewhere" in out, out[-4000:]
    assert "lease expired" in out, out[-4000:]
    last = out.strip().splitlines()[-1]
    assert last.startswith(f"jaxrat: error: The workdir {wd} holds checkpoints of a run with another config "
                           f"(data.image_size: 32 -> 48): "), last
    assert not os.path.exists(os.path.join(wd, LOCK_NAME))  # released by the failed start

    run = Run(wd, ["--config.num_train_steps=9"], env, str(tmp_path / "3.log"))
    assert run.wait() == 0, run.output()[-4000:]
    out = run.output()
    assert "resumed from step 6 " in out and "num_train_steps: 6 -> 9" in out, out[-4000:]
    assert sorted(losses_by_step(wd)) == list(range(1, 10))
    assert json.load(open(os.path.join(wd, "config.json")))["num_train_steps"] == 9
    kept = [n for n in os.listdir(wd) if n.startswith("config.") and n != "config.json"]
    assert len(kept) == 1 and json.load(open(os.path.join(wd, kept[0])))["num_train_steps"] == 6, kept


@pytest.mark.slow
def test_every_process_of_a_second_run_stops_with_process_0s_sentence(tmp_path, compile_cache):
    wd = str(tmp_path / "wd")
    os.makedirs(wd)
    me = Holder.this_process()  # this test's own process: alive, on this host
    with open(os.path.join(wd, LOCK_NAME), "w") as f:
        json.dump(dataclasses.asdict(me), f)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    runs = [Run(wd, [f"--config.distributed.coordinator_address=127.0.0.1:{port}",
                     "--config.distributed.num_processes=2", f"--config.distributed.process_id={i}"],
                cached_env(2, compile_cache), str(tmp_path / f"p{i}.log")) for i in range(2)]
    try:
        codes = [r.wait(180) for r in runs]
    finally:
        for r in runs:
            r.kill()
    lasts = [[line for line in r.output().splitlines() if line.startswith("jaxrat: error:")] for r in runs]
    assert codes == [2, 2], "\n---\n".join(r.output()[-3000:] for r in runs)
    assert len(lasts[0]) == 1 and lasts[0] == lasts[1], lasts  # process 1 prints process 0's sentence
    assert f"is in use by another run (process {os.getpid()} on host {me.host}, since " in lasts[0][0], lasts
    assert json.load(open(os.path.join(wd, LOCK_NAME)))["token"] == me.token  # untouched
