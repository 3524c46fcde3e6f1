"""python -m jaxrat.evaluate: a trained run's checkpoint scored again, at its own or another resolution."""

import json
import os
import subprocess
import sys

import pytest

from runner import REPO, env_with_devices, read_metrics, run_main

pytestmark = pytest.mark.slow


def _evaluate(workdir, *args):
    return subprocess.run([sys.executable, "-m", "jaxrat.evaluate", f"--workdir={workdir}", *args], cwd=REPO,
                          env=env_with_devices(2), capture_output=True, text=True, timeout=300)


def test_evaluate_reproduces_the_last_eval_and_takes_overrides(tmp_path):
    wd = str(tmp_path / "run")
    # Metrics at the original resolution too (the synthetic images are larger than the 32 px smoke size).
    run_main(wd, "--config.checkpoint.best_metric=eval/dice", "--config.task.eval_original_resolution=True", devices=1)
    last = [r for r in read_metrics(wd) if "eval/dice" in r][-1]
    before = sorted(os.listdir(os.path.join(wd, "checkpoints")))

    proc = _evaluate(wd, "--step=latest")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.load(open(os.path.join(wd, "eval", "step_6", "metrics.json")))
    assert result["step"] == 6
    for key in ("eval/dice", "eval/iou", "eval/loss", "eval/sensitivity", "eval/jaccard_thresholded", "eval/orig/dice",
                "eval/orig/jaccard_thresholded", "eval/orig/specificity"):
        assert result["metrics"][key] == pytest.approx(last[key], abs=1e-6), key

    proc = _evaluate(wd, "--step=best", "--name=at48", "--config.data.image_size=48")
    assert proc.returncode == 0, proc.stderr[-3000:]
    at48 = json.load(open(os.path.join(wd, "eval", "at48", "metrics.json")))
    assert at48["config"]["data"]["image_size"] == 48 and at48["metrics"]["eval/num_images"] == 8
    assert at48["metrics"]["eval/orig/num_images"] == 8
    assert sorted(os.listdir(os.path.join(wd, "checkpoints"))) == before  # only read

    proc = _evaluate(wd, "--config.data.imagesize=48")
    assert proc.returncode == 2 and "Unknown config key --config.data.imagesize" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = _evaluate(wd, "--step=3000")
    assert proc.returncode == 2 and "no complete checkpoint at step 3000" in proc.stderr
    proc = _evaluate(str(tmp_path / "nothing"))
    assert proc.returncode == 2 and "config.json not found" in proc.stderr
    proc = _evaluate(wd, "--name=../../escaped")  # wrote outside WORKDIR/eval
    assert proc.returncode == 2 and "leads out of" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "escaped").exists()
    proc = _evaluate(wd, "--out=/sys/jaxrat_eval")  # a folder that cannot be written: one sentence
    assert proc.returncode == 2 and "Cannot write the evaluation to /sys/jaxrat_eval" in proc.stderr
    assert "Traceback" not in proc.stderr
    from jaxrat.trainer.workdir_lock import OutputFolderLock

    busy = os.path.join(wd, "eval", "busy")
    lock = OutputFolderLock(busy)  # another evaluate writing there: this live process
    os.makedirs(busy)
    lock.acquire()
    try:
        proc = _evaluate(wd, "--name=busy")
    finally:
        lock.release()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"The output folder {busy} is in use by another command (process {os.getpid()}" in proc.stderr
    assert "or pass another --name (or --out)." in proc.stderr  # its own folder: --name is the way around
    assert os.listdir(busy) == []

    # --out: a new folder, then the same folder again only with --overwrite, which replaces the
    # evaluation's files (TensorBoard's too) and keeps one the user added.
    out = str(tmp_path / "scores")
    assert _evaluate(wd, f"--out={out}").returncode == 0
    open(os.path.join(out, "notes.txt"), "w").write("mine")
    proc = _evaluate(wd, f"--out={out}")
    assert proc.returncode == 2 and "exists and is not empty; choose a new folder or pass --overwrite" in proc.stderr
    events = sorted(os.listdir(os.path.join(out, "tensorboard")))
    proc = _evaluate(wd, f"--out={out}", "--overwrite")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "eval/dice" in json.load(open(os.path.join(out, "metrics.json")))["metrics"]
    assert len(read_metrics(out)) == 1  # not appended to the first evaluation's
    assert open(os.path.join(out, "notes.txt")).read() == "mine"
    assert not set(events) & set(os.listdir(os.path.join(out, "tensorboard")))


def _files(root):
    return {os.path.relpath(os.path.join(d, n), root): os.stat(os.path.join(d, n)).st_mtime_ns
            for d, _, names in os.walk(root) for n in names}


def test_evaluate_reads_the_runs_synthetic_data_instead_of_copying_it(tmp_path):
    """Each evaluation folder held a copy of the whole synthetic dataset (9 MB for isic:demo)."""
    wd = str(tmp_path / "run")
    run_main(wd, devices=1)
    last = [r for r in read_metrics(wd) if "eval/dice" in r][-1]
    data = os.path.join(wd, "synthetic_data")
    before = _files(data)
    for args, folder in (((), os.path.join(wd, "eval", "step_6")), ((f"--out={tmp_path / 'scores'}",),
                                                                    str(tmp_path / "scores"))):
        proc = _evaluate(wd, "--step=latest", *args)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert not os.path.exists(os.path.join(folder, "synthetic_data")), os.listdir(folder)
        result = json.load(open(os.path.join(folder, "metrics.json")))
        for key in ("eval/dice", "eval/iou", "eval/loss", "eval/num_images"):  # the data training scored
            assert result["metrics"][key] == pytest.approx(last[key], abs=1e-6), key
    assert _files(data) == before  # only read
