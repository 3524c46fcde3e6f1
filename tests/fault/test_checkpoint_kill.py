"""kill -9 at random moments (mid-save included), relaunch, repeat; the result equals an uninterrupted run.

Saves every step (async), so most kills land while a checkpoint is being written. The loop runs
for a fixed time budget (``JAXRAT_KILL_TEST_SECONDS``, default 30: each CI run draws a new seed, so the
kill points add up over runs; set it higher for a long campaign) and needs a minimum number of trials,
the first three one of each mode; every subprocess has its own timeout.
"""

import os
import random
import signal
import time

from jaxrat.checkpointing import store
from runner import losses_by_step
from test_preempt import Run, assert_same_run, cached_env, compile_cache, train_steps_logged, wait_until  # noqa: F401

BUDGET_S = float(os.environ.get("JAXRAT_KILL_TEST_SECONDS", "30"))
MIN_TRIALS = 6
STEPS = 100  # more than the trials can reach: a trial trains for at most ~1.5 s
BASE = [f"--config.num_train_steps={STEPS}", "--config.train.eval_every=100000", "--config.checkpoint.best_metric="]
# Killed runs save every step; when to save does not change the numbers, so the reference and the
# last resume (both uninterrupted) save rarely and finish fast.
ARGS = [*BASE, "--config.checkpoint.every_steps=1", "--config.checkpoint.keep=2"]
QUIET = [*BASE, "--config.checkpoint.every_steps=1000"]
MODES = ("mid-save", "in the loop", "at any time")


def _tmp_dirs(directory: str) -> list[str]:
    return [n for n in os.listdir(directory) if ".orbax-checkpoint-tmp" in n] if os.path.isdir(directory) else []


def test_random_kill9_and_resume_reproduce_the_uninterrupted_run(tmp_path, compile_cache):
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    cache = compile_cache
    ref, wd = str(tmp_path / "ref"), str(tmp_path / "killed")
    ckdir = os.path.join(wd, "checkpoints")
    run = Run(ref, QUIET, cached_env(1, cache), str(tmp_path / "ref.log"))  # also fills the compile cache
    assert run.wait() == 0, run.output()[-4000:]

    trials, mid_save, finished = [], 0, False
    startup = 15.0  # seconds from launch to the first new train step, updated as trials go
    start = time.time()
    while not finished and (time.time() - start < BUDGET_S or len(trials) < MIN_TRIALS):
        before = store.committed_steps(ckdir)
        logged = max(train_steps_logged(wd), default=0)
        mode = MODES[len(trials)] if len(trials) < len(MODES) else rng.choice(MODES)
        run = Run(wd, ARGS, cached_env(1, cache), str(tmp_path / f"trial{len(trials)}.log"))
        launched = time.time()
        try:
            if mode == "at any time":  # import, data, compile, restore or training
                deadline = launched + rng.uniform(0.5, startup + 1.5)
                while time.time() < deadline and run.proc.poll() is None:
                    time.sleep(0.01)
            else:
                wait_until(lambda: max(train_steps_logged(wd), default=0) > logged or run.proc.poll() is not None,
                           [], what="a new train step")
                startup = time.time() - launched
                if mode == "mid-save":
                    deadline = time.time() + 5
                    while not _tmp_dirs(ckdir) and run.proc.poll() is None and time.time() < deadline:
                        time.sleep(0.001)
                else:
                    time.sleep(rng.uniform(0.0, 1.5))
            if run.proc.poll() is None:
                run.proc.send_signal(signal.SIGKILL)
            code = run.wait(60)
        finally:
            run.kill()
        out = run.output()
        left = _tmp_dirs(ckdir)
        mid_save += bool(left) and code == -signal.SIGKILL
        trials.append({"mode": mode, "code": code, "restored": before[-1] if before else None,
                       "after": store.committed_steps(ckdir), "tmp_left": left})
        context = f"seed {seed}, trial {len(trials)}: {trials[-1]}\n{out[-3000:]}"
        assert code in (0, -signal.SIGKILL), context  # nothing may fail by itself
        if before and "resumed from step" in out:  # every start that got as far as restoring
            assert f"resumed from step {before[-1]} " in out, context
        assert "Traceback" not in out, context
        finished = code == 0

    if not finished:
        run = Run(wd, QUIET, cached_env(1, cache), str(tmp_path / "final.log"))
        assert run.wait() == 0, f"seed {seed}: the final resume failed:\n{run.output()[-4000:]}"
    summary = f"seed {seed}; {len(trials)} trials, {mid_save} killed mid-save: {trials}"
    print(summary)
    assert len(trials) >= MIN_TRIALS, summary
    assert mid_save >= 1, summary
    assert not _tmp_dirs(ckdir) or not finished, summary
    assert_same_run(ref, wd)
    a, b = losses_by_step(ref), losses_by_step(wd)
    diff = max(abs(a[k] - b[k]) for k in a)
    print(f"max |loss - uninterrupted loss| over {STEPS} steps: {diff:.3g}")
