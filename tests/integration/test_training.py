"""End-to-end training through ``python -m jaxrat.main`` on simulated CPU devices."""

import json
import os
import signal
import subprocess
import time

import numpy as np
import pytest

from runner import REPO, env_with_devices, losses_by_step, main_cmd, read_metrics, run_main

STEPS = ["--config.num_train_steps=6", "--config.train.log_every=1"]


def _assert_same_losses(a: dict, b: dict, rtol: float):
    assert sorted(a) == sorted(b) and len(a) >= 6
    np.testing.assert_allclose([a[k] for k in sorted(a)], [b[k] for k in sorted(b)], rtol=rtol, atol=0)


@pytest.fixture(scope="module")
def one_device_run(tmp_path_factory):
    wd = str(tmp_path_factory.mktemp("one"))
    run_main(wd, *STEPS, devices=1)
    return wd


def test_outputs_logs_and_config(one_device_run):
    wd = one_device_run
    rows = read_metrics(wd)
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2, 3, 4, 5, 6]
    evals = [r for r in rows if "eval/dice" in r]
    assert [r["step"] for r in evals] == [3, 6]
    for key in ("eval/dice", "eval/iou", "eval/sensitivity", "eval/specificity", "eval/accuracy", "eval/loss"):
        assert all(np.isfinite(r[key]) for r in evals), key
    for key in ("train/learning_rate", "train/steps_per_sec", "train/examples_per_sec", "train/grad_norm"):
        assert key in rows[0]
    cfg = json.load(open(os.path.join(wd, "config.json")))
    assert cfg["num_train_steps"] == 6 and cfg["model"]["name"] == "unet"
    assert sorted(n for n in os.listdir(os.path.join(wd, "checkpoints")) if n.isdigit()) == ["3", "6"]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(os.path.join(wd, "tensorboard"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {"train/loss", "train/learning_rate", "train/steps_per_sec", "eval/dice", "eval/iou"} <= set(tags)
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize(
    "overrides",
    [
        [],  # pure data parallel over 8 devices
        ["--config.mesh.axes=(('data', 2), ('fsdp', 4))", "--config.sharding.zero=3", "--config.sharding.min_size=1"],
        ["--config.mesh.axes=(('data', 4), ('fsdp', 2))", "--config.sharding.zero=1", "--config.sharding.min_size=1"],
    ],
    ids=["dp8", "zero3", "zero1"],
)
def test_eight_devices_match_one_device(one_device_run, tmp_path, overrides):
    run_main(str(tmp_path), *STEPS, *overrides, devices=8)
    _assert_same_losses(losses_by_step(one_device_run), losses_by_step(str(tmp_path)), rtol=1e-5)


def test_gradient_accumulation_matches_full_batch(one_device_run, tmp_path):
    run_main(str(tmp_path), *STEPS, "--config.optimizer.grad_accum_steps=2", devices=2)
    _assert_same_losses(losses_by_step(one_device_run), losses_by_step(str(tmp_path)), rtol=1e-5)


def test_second_run_with_same_steps_resumes_and_does_nothing(one_device_run, tmp_path):
    import shutil

    wd = str(tmp_path / "wd")
    shutil.copytree(one_device_run, wd)
    before = len(read_metrics(wd))
    proc = run_main(wd, *STEPS, devices=1)
    assert "resumed from step 6" in proc.stderr
    assert len(read_metrics(wd)) == before


def test_sigkill_and_resume_reproduce_the_uninterrupted_losses(tmp_path):
    args = ["--config.num_train_steps=40", "--config.train.log_every=1", "--config.checkpoint.every_steps=4",
            "--config.train.eval_every=1000", "--config.data.image_size=64", "--config.model.features=(8, 16)"]
    # The uninterrupted reference trains meanwhile, in its own process: two processes overlap their
    # start-up and compilation on a 2-core machine.
    ref = str(tmp_path / "ref")
    with open(tmp_path / "ref.log", "w") as log:
        reference = subprocess.Popen(main_cmd(ref, *args), env=env_with_devices(2), cwd=REPO, stdout=log,
                                     stderr=subprocess.STDOUT)
    try:
        wd = str(tmp_path / "killed")
        proc = subprocess.Popen(main_cmd(wd, *args), env=env_with_devices(2), cwd=REPO,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        metrics = os.path.join(wd, "metrics.jsonl")
        deadline = time.time() + 240
        try:
            while time.time() < deadline:
                if os.path.exists(metrics) and len(open(metrics).read().splitlines()) >= 10:
                    break
                time.sleep(0.02)
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.wait(timeout=30)
        assert proc.returncode == -signal.SIGKILL
        killed_at = max(losses_by_step(wd))
        assert killed_at < 40, "the run finished before it could be killed"

        resumed = run_main(wd, *args, devices=2)
        assert "resumed from step" in resumed.stderr
        assert reference.wait(timeout=300) == 0, (tmp_path / "ref.log").read_text()[-4000:]
    finally:
        if reference.poll() is None:
            reference.kill()
            reference.wait(timeout=30)
    _assert_same_losses(losses_by_step(ref), losses_by_step(wd), rtol=1e-6)
