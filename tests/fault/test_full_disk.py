"""A workdir on a 64 MiB tmpfs that fills up during training: the run stops with one sentence, its
checkpoints are intact, no temporary or partial file is left anywhere in the workdir, and once space
is freed the same command resumes and finishes.

Needs root to mount the tmpfs (skipped otherwise; tests/unit/test_fileio.py covers the same failures
with a refused write and a refused fsync in-process).
"""

from __future__ import annotations

import glob
import json
import os
import subprocess

import pytest

from jaxrat.checkpointing.store import committed_steps
from runner import fill_disk, losses_by_step
from test_preempt import Run, cached_env, compile_cache, train_steps_logged, wait_until  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.integration]

STEPS = 30
ARGS = [f"--config.num_train_steps={STEPS}", "--config.train.eval_every=100000", "--config.train.eval_at_end=false",
        "--config.checkpoint.best_metric=", "--config.train.log_every=1", "--config.checkpoint.every_steps=1",
        "--config.checkpoint.keep=2"]


@pytest.fixture
def small_disk(tmp_path):
    where = tmp_path / "disk"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(where)], capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.decode().strip() or 'needs root'})")
    yield str(where)
    subprocess.run(["umount", "-l", str(where)], check=False)


def _leftovers(workdir: str) -> list[str]:
    """Temporaries of any writer: fileio's ``.NAME.*.tmp``, any ``*.tmp``, Orbax's unfinished saves."""
    found = []
    for root, dirs, files in os.walk(workdir):
        for name in files + dirs:
            if name.endswith(".tmp") or ".tmp." in name or "orbax-checkpoint-tmp" in name or name.endswith(".part"):
                found.append(os.path.join(root, name))
    return found


def _whole(workdir: str) -> None:
    """Every JSON file parses and every line of metrics.jsonl is a whole record."""
    for path in glob.glob(os.path.join(workdir, "*.json")):
        with open(path) as f:
            json.load(f)
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        for line in f:
            json.loads(line)


def test_a_full_disk_stops_with_a_sentence_keeps_checkpoints_leaves_no_temporaries_and_resumes(
        small_disk, tmp_path, compile_cache):
    wd = os.path.join(small_disk, "run")
    ckdir = os.path.join(wd, "checkpoints")
    ballast = os.path.join(small_disk, "ballast")
    run = Run(wd, ARGS, cached_env(1, compile_cache), str(tmp_path / "1.log"))
    try:
        wait_until(lambda: len(train_steps_logged(wd)) >= 3 and committed_steps(ckdir), [run],
                   what="3 train steps and a checkpoint")
        fill_disk(ballast)
        code = run.wait()
    finally:
        run.kill()
    out = run.output()
    last = out.strip().splitlines()[-1]
    assert code == 2, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    assert last.startswith("jaxrat: error:") and "full" in last and last.count(". ") == 0, last
    kept = committed_steps(ckdir)
    assert kept, f"no checkpoint left: {os.listdir(ckdir)}"
    assert _leftovers(wd) == [], _leftovers(wd)
    _whole(wd)

    os.remove(ballast)
    run = Run(wd, ARGS, cached_env(1, compile_cache), str(tmp_path / "2.log"))
    code = run.wait()
    out = run.output()
    assert code == 0, out[-4000:]
    assert f"resumed from step {kept[-1]}" in out, out[-4000:]
    assert not os.path.exists(os.path.join(ckdir, "damaged")), "a checkpoint saved before the disk filled is unreadable"
    assert sorted(losses_by_step(wd)) == list(range(1, STEPS + 1))
    assert _leftovers(wd) == [], _leftovers(wd)
    _whole(wd)
