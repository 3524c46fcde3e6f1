"""Real multi-process training on 127.0.0.1: `python -m jaxrat.main` started 2 and 4 times with
explicit coordinator flags (gloo CPU collectives, several CPU devices per process).

* The per-step training losses equal those of one process with the same global batch and the
  same total device count (8), to 1e-5.
* A checkpoint written by 2 processes restores in 1 process on another device count (2), and
  the continued steps reproduce the uninterrupted run's losses.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from runner import run_processes

pytestmark = pytest.mark.slow

DEVICES = 8  # global device count of every run compared here
STEPS = 8
# Checkpoints at 3, 6 and 8; no evaluation in the middle (it only costs time here).
OVERRIDES = [f"--config.num_train_steps={STEPS}", "--config.checkpoint.every_steps=3",
             "--config.train.eval_every=1000", "--config.train.eval_at_end=False"]
TIMEOUT = 600


def train(workdir: Path, processes: int, devices: int = DEVICES, extra: tuple[str, ...] = ()) -> list[str]:
    """Run jaxrat.main in `processes` processes sharing `devices` CPU devices; return their logs."""
    return run_processes(workdir, processes, devices, [*OVERRIDES, *extra], timeout=TIMEOUT)


def losses(workdir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


def assert_close(got: dict[int, float], want: dict[int, float], steps) -> None:
    diffs = {step: abs(got[step] - want[step]) for step in steps}
    print(f"max |loss - reference| over steps {list(steps)}: {max(diffs.values()):.2e}")
    for step in steps:
        assert diffs[step] <= 1e-5, (step, got[step], want[step])


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    """One process with all 8 devices."""
    workdir = tmp_path_factory.mktemp("mp") / "one"
    train(workdir, 1)
    result = losses(workdir)
    assert sorted(result) == list(range(1, STEPS + 1))
    return result


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory) -> Path:
    workdir = tmp_path_factory.mktemp("mp") / "two"
    logs = train(workdir, 2)
    for i, text in enumerate(logs):
        assert f"launcher=explicit process={i}/2 local_devices=4 local_device_ids=all global_devices=8" in text
    return workdir


def test_two_processes_match_one(reference, two_process_run):
    assert_close(losses(two_process_run), reference, range(1, STEPS + 1))
    assert {p.name for p in (two_process_run / "checkpoints").iterdir()} >= {"3", "6", "8"}


def test_four_processes_match_one(reference, tmp_path):
    # Auto input workers: the 4 processes find each other on this host (a collective) and share
    # its cores; whatever the worker count, the batches and so the losses are the same.
    logs = train(tmp_path / "four", 4, extra=("--config.data.num_workers=-1",))
    assert "launcher=explicit process=3/4 local_devices=2 local_device_ids=all global_devices=8" in logs[3]
    mine = len(os.sched_getaffinity(0))
    cores = max(1, mine // 4) if mine >= (os.cpu_count() or 1) else mine  # unpinned: a quarter each
    for text in logs:
        found = re.search(r"data: (\d+) worker processes \((\d+) cores for this process", text)
        assert found and int(found[2]) == cores and int(found[1]) <= cores - 1, text[-3000:]
    assert_close(losses(tmp_path / "four"), reference, range(1, STEPS + 1))


def test_checkpoint_from_two_processes_resumes_in_one_process_on_two_devices(reference, two_process_run, tmp_path):
    workdir = tmp_path / "resumed"
    shutil.copytree(two_process_run, workdir)
    shutil.rmtree(workdir / "checkpoints" / "8")  # as if the 2-process run had stopped after step 6
    (workdir / "metrics.jsonl").unlink()
    logs = train(workdir, 1, devices=2)
    assert "resumed from step 6" in logs[0]
    assert "global_devices=2" in logs[0]
    got = losses(workdir)
    assert sorted(got) == [7, 8]
    assert_close(got, reference, [7, 8])
