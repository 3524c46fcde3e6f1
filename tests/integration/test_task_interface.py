"""The trainer knows no task: a user's toy task trains through ``python -m jaxrat.main``."""

import os
import pathlib
import re
import shutil
import subprocess

import pytest

from runner import REPO, env_with_devices, losses_by_step, main_cmd, read_metrics

TOY = os.path.join(REPO, "tests", "toy")
TOY_CONFIG = os.path.join(TOY, "toy_config.py")


def _run(workdir, *overrides, devices=1, check=True):
    env = env_with_devices(devices)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (TOY, env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(main_cmd(str(workdir), *overrides, config=TOY_CONFIG), env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    if check:
        assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


@pytest.mark.slow
def test_a_toy_task_trains_evaluates_ranks_and_resumes(tmp_path):
    _run(tmp_path / "full", devices=2)
    losses = losses_by_step(str(tmp_path / "full"))
    assert losses[30] < 0.1 * losses[5], losses
    evals = [r for r in read_metrics(str(tmp_path / "full")) if "eval/mse" in r]
    assert [r["step"] for r in evals] == [10, 20, 30] and evals[-1]["eval/mse"] < evals[0]["eval/mse"]
    assert "train/abs_err" in read_metrics(str(tmp_path / "full"))[0]
    best = (tmp_path / "full" / "checkpoints" / "best.json").read_text()
    assert '"metric": "eval/mse"' in best

    # Drop the last checkpoint: the next start resumes at step 20, on one device instead of two.
    shutil.rmtree(tmp_path / "full" / "checkpoints" / "30")
    _run(tmp_path / "full", devices=1)
    resumed = losses_by_step(str(tmp_path / "full"))
    for step in (25, 30):
        assert resumed[step] == pytest.approx(losses[step], abs=1e-6)


def test_a_task_that_cannot_be_found_is_one_sentence(tmp_path):
    proc = _run(tmp_path, "--config.task.name=no_such_module:Task", check=False)
    assert proc.returncode == 2
    assert "config.task.name='no_such_module:Task'" in proc.stderr and "Traceback" not in proc.stderr
    proc = _run(tmp_path, "--config.task.name=detector", check=False)
    assert proc.returncode == 2 and "neither a built-in task" in proc.stderr


def test_the_trainer_names_no_task_metric_or_batch_field():
    # Task and dataset names, metric names, and batch fields as subscripts or string keys.
    words = re.compile(r"segment|detect|classif|regress|\bisic|\bcoco|\b(dice|iou|bce|mse|AP)\b|accuracy|"
                       r"[\"'](image|mask|masks|label|labels|boxes|valid|x|y)[\"']", re.IGNORECASE)
    for path in sorted(pathlib.Path(REPO, "jaxrat", "trainer").glob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            assert not words.search(line), f"{path.name}:{n}: {line.strip()}"
