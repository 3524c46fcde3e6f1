"""EMA end to end: kill -9 and resume give the uninterrupted run's average bit for bit; eval/* is
the average's (and what jaxrat.evaluate scores), eval_raw/* the raw parameters'."""

import json
import os
import signal
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jaxrat.checkpointing import store
from runner import REPO, env_with_devices, read_metrics, run_main
from test_preempt import Run, cached_env, compile_cache, wait_until  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.integration]

STEPS = 12
ARGS = [f"--config.num_train_steps={STEPS}", "--config.optimizer.ema_decay=0.9", "--config.train.eval_every=6",
        "--config.checkpoint.best_metric=eval/loss", "--config.checkpoint.best_mode=min"]


def _state(workdir: str, step: int) -> dict:
    with ocp.PyTreeCheckpointer() as ckptr:
        return ckptr.restore(os.path.join(workdir, "checkpoints", str(step), "state"))


def _same(a, b) -> None:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb) and la
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_kill9_and_resume_give_the_same_average_and_evaluate_scores_it(tmp_path, compile_cache):
    ref, wd = str(tmp_path / "ref"), str(tmp_path / "killed")
    env = cached_env(1, compile_cache)
    run = Run(ref, ARGS, env, str(tmp_path / "ref.log"))
    assert run.wait() == 0, run.output()[-4000:]

    # Saving every step, killed once a few steps are committed (mid-run, maybe mid-save).
    run = Run(wd, [*ARGS, "--config.checkpoint.every_steps=1"], env, str(tmp_path / "killed.log"))
    try:
        wait_until(lambda: len(store.committed_steps(os.path.join(wd, "checkpoints"))) >= 2, [run],
                   what="two checkpoints")
        run.proc.send_signal(signal.SIGKILL)
        assert run.wait(60) == -signal.SIGKILL
    finally:
        run.kill()
    resumed_from = store.committed_steps(os.path.join(wd, "checkpoints"))[-1]
    assert resumed_from < STEPS
    proc = run_main(wd, *ARGS, "--config.checkpoint.every_steps=1")
    assert f"resumed from step {resumed_from} " in proc.stderr + proc.stdout

    a, b = _state(ref, STEPS), _state(wd, STEPS)
    _same(a["ema_params"], b["ema_params"])
    _same(a["params"], b["params"])
    assert any(not np.array_equal(np.asarray(x), np.asarray(y))
               for x, y in zip(jax.tree.leaves(a["ema_params"]), jax.tree.leaves(a["params"])))

    last = [r for r in read_metrics(ref) if "eval/loss" in r][-1]
    assert "eval_raw/loss" in last and last["eval_raw/loss"] != last["eval/loss"]
    summary = json.load(open(os.path.join(ref, "summary.json")))
    assert summary["last_eval"]["eval_raw/loss"] == pytest.approx(last["eval_raw/loss"])
    assert summary["best"]["metric"] == "eval/loss"

    proc = subprocess.run([sys.executable, "-m", "jaxrat.evaluate", f"--workdir={ref}", "--step=latest"], cwd=REPO,
                          env=env_with_devices(1), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    scored = json.load(open(os.path.join(ref, "eval", f"step_{STEPS}", "metrics.json")))["metrics"]
    assert scored["eval/loss"] == pytest.approx(last["eval/loss"], abs=1e-6)
