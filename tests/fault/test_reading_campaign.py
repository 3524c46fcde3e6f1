"""A bounded fault campaign for the read side: ``jaxrat.evaluate`` and ``jaxrat.predict`` run again
and again beside a training that saves every step and keeps two checkpoints (so the step a reader
chose is rotated away under it), some of them killed with -9 at random points. Every reader that
finishes scores a complete step exactly as that step scores undisturbed, none ends in a traceback,
and the training's checkpoints are never damaged: it finishes, and a final evaluate reproduces its
last evaluation. The training layer's campaign is tests/fault/test_chaos.py.

The points are drawn from ``JAXRAT_FAULT_SEED`` (default 0), so a failure can be replayed.
"""

from __future__ import annotations

import csv
import json
import os
import random
import re
import subprocess
import sys
import time

import pytest

from jaxrat.checkpointing import reading, store
from predict_inputs import write_inputs
from runner import REPO, env_with_devices, main_cmd, read_metrics, run_main

pytestmark = [pytest.mark.slow, pytest.mark.integration]

STEPS = 60
TRAIN = [f"--config.num_train_steps={STEPS}", "--config.train.eval_every=1", "--config.checkpoint.every_steps=1",
         "--config.checkpoint.best_metric="]  # nothing ranked: the readers take the latest step


def _reader(kind: str, workdir: str, out: str, *args: str) -> subprocess.Popen:
    extra = ["--noprogress"] if kind == "predict" else []
    return subprocess.Popen([sys.executable, "-m", f"jaxrat.{kind}", *extra, f"--workdir={workdir}", f"--out={out}",
                             *args], cwd=REPO, env=env_with_devices(1), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _predictions(out: str) -> list[dict]:
    with open(os.path.join(out, "predictions.csv")) as f:
        return list(csv.DictReader(f))


def _evaluated(out: str) -> tuple[int, dict]:
    with open(os.path.join(out, "metrics.json")) as f:
        result = json.load(f)
    return result["step"], result["metrics"]


def _pins(workdir: str) -> list[str]:
    return [n for n in os.listdir(workdir) if n.startswith(reading.PIN_PREFIX)]


def test_readers_killed_beside_a_rotating_training_report_only_complete_steps(tmp_path):
    rng = random.Random(int(os.environ.get("JAXRAT_FAULT_SEED", "0")))
    images = str(tmp_path / "images")
    write_inputs(images)
    reference = str(tmp_path / "reference")  # the same run, every step kept: what each step scores undisturbed
    run_main(reference, *TRAIN, f"--config.checkpoint.keep={STEPS}", timeout=600)
    workdir = str(tmp_path / "run")
    log = open(tmp_path / "train.log", "w")
    training = subprocess.Popen(main_cmd(workdir, *TRAIN, "--config.checkpoint.keep=2"), cwd=REPO,
                                env=env_with_devices(1), stdout=log, stderr=subprocess.STDOUT)
    directory = os.path.join(workdir, "checkpoints")
    finished: list[tuple[str, str, str]] = []  # (kind, out, stderr)
    killed = 0
    try:
        while not store.committed_steps(directory) and training.poll() is None:
            time.sleep(0.1)
        n = 0
        # An evaluate and a predict at once, each perhaps killed, while the training runs (and after it,
        # until each kind has finished once and one was killed, however slow this machine is).
        while training.poll() is None or (n < 20 and not (killed and {k for k, _, _ in finished} == {
                "evaluate", "predict"})):
            t0, readers = time.monotonic(), []
            for kind in ("evaluate", "predict"):
                out = str(tmp_path / f"{kind}_{n}")
                proc = _reader(kind, workdir, out, *([f"--input={images}"] if kind == "predict" else []))
                # kill -9 anywhere: choosing the step, holding it, reading it, writing the results
                readers.append((kind, out, proc, rng.uniform(0.2, 4.0) if rng.random() < 0.4 else None))
            for kind, out, proc, kill_at in sorted(readers, key=lambda r: r[3] or 1e9):
                if kill_at is not None:
                    time.sleep(max(0.0, t0 + kill_at - time.monotonic()))
                    proc.kill()
                    proc.communicate()
                    killed += 1
                    continue
                _, err = proc.communicate(timeout=300)
                assert proc.returncode == 0 and "Traceback" not in err, err[-3000:]
                finished.append((kind, out, err))
            n += 1
        assert training.wait() == 0, open(tmp_path / "train.log").read()[-3000:]
    finally:
        if training.poll() is None:
            training.kill()
            training.wait()
    assert killed and {k for k, _, _ in finished} == {"evaluate", "predict"}, (killed, len(finished))
    def evals(wd):
        return {r["step"]: {k: v for k, v in r.items() if k.startswith("eval/")} for r in read_metrics(wd)
                if "eval/dice" in r}

    record = evals(reference)
    assert evals(workdir) == record  # the same run, bit for bit
    steps = set()
    for kind, out, err in finished:
        if kind == "evaluate":
            step, metrics = _evaluated(out)
            for key in set(metrics) & set(record[step]):
                assert metrics[key] == pytest.approx(record[step][key], abs=1e-6), (step, key)
        else:
            step = int(re.search(r"predict: .* step (\d+),", err).group(1))
            again = str(tmp_path / f"again_{out.rsplit('_', 1)[1]}")
            proc = _reader("predict", reference, again, f"--input={images}", f"--step={step}")
            _, e = proc.communicate(timeout=300)
            assert proc.returncode == 0, e[-3000:]
            assert _predictions(out) == _predictions(again), step
        steps.add(step)
    assert len(steps) > 1, steps  # the readers saw the training move on
    assert store.committed_steps(directory) == [STEPS - 1, STEPS]
    final = _reader("evaluate", workdir, str(tmp_path / "final"), "--step=latest")
    _, err = final.communicate(timeout=300)
    assert final.returncode == 0, err[-3000:]
    step, metrics = _evaluated(str(tmp_path / "final"))
    assert step == STEPS and metrics["eval/dice"] == pytest.approx(record[STEPS]["eval/dice"], abs=1e-6)
    assert not _pins(workdir)  # the killed readers' links of rotated steps were cleaned up
