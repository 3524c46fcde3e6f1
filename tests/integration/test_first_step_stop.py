"""benchmarks/first_step.py stops each run at exactly its ``--steps``-th step, however late its parent looks.

Its SIGTERM used to come from the parent once a poll of ``metrics.jsonl`` saw the step: on a busy
machine the smoke config's 6 steps were all done by then, the cold run ended on its own (exit 0,
final checkpoint) and the requeued run "exited 0 without logging a step".
"""

from __future__ import annotations

import os
import time

import pytest

from benchmark_scripts import load
from jaxrat.checkpointing import store
from jaxrat.cluster import PREEMPTED_EXIT_CODE

pytestmark = [pytest.mark.slow, pytest.mark.integration]

SMOKE = "configs/isic.py:smoke"  # 6 steps, a few milliseconds each once compiled


class _LateParent:
    """The benchmark's clock on a loaded machine: each of its sleeps lasts a minute longer (a
    watcher that looked after every poll would see the smoke run only once it had ended)."""

    perf_counter = staticmethod(time.perf_counter)

    @staticmethod
    def sleep(seconds: float) -> None:
        time.sleep(seconds + 60)


def _train_steps(workdir: str) -> list[int]:
    return [r["step"] for r in load("first_step")._rows(workdir) if "train/loss" in r]


def test_cold_run_stops_at_its_step_and_leaves_the_requeued_run_a_step(tmp_path, monkeypatch):
    first_step = load("first_step")
    monkeypatch.setattr(first_step, "time", _LateParent)
    monkeypatch.delenv("XLA_FLAGS", raising=False)  # one device, as a user runs the benchmark
    wd, cache = str(tmp_path / "a"), str(tmp_path / "xla-cache")
    checkpoints = os.path.join(wd, "checkpoints")

    cold = first_step.run(SMOKE, 1, wd, cache, timeout=600)
    assert cold["exit"] == PREEMPTED_EXIT_CODE, cold
    assert _train_steps(wd) == [1] and store.committed_steps(checkpoints) == [1]
    first_step._check_requeueable(wd, cold["exit"])

    requeued = first_step.run(SMOKE, 1, wd, cache, timeout=600)
    assert requeued["exit"] == PREEMPTED_EXIT_CODE, requeued
    assert _train_steps(wd) == [1, 2] and store.committed_steps(checkpoints) == [1, 2]


def test_a_cold_run_that_reached_its_last_step_is_one_sentence(tmp_path):
    first_step = load("first_step")
    (tmp_path / "summary.json").write_text('{"steps": {"first": 0, "last": 6, "total": 6}}')
    with pytest.raises(SystemExit, match=r"^the cold run ended at step 6 of 6 \(exit 0\), .* below 6\.$"):
        first_step._check_requeueable(str(tmp_path), 0)
    (tmp_path / "summary.json").unlink()
    with pytest.raises(SystemExit, match=r"^the cold run exited 1 without writing .*summary\.json; see its log"):
        first_step._check_requeueable(str(tmp_path), 1)
