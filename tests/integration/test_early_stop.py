"""Early stopping: the rule, its state across a resume, and the run and sweep that see it end."""

import json
import os

import pytest

from jaxrat.checkpointing.store import committed_steps, step_metadata, stopped_early
from jaxrat.config_schema import load_config
from jaxrat.experiments.sweep import run_state
from jaxrat.runtime.errors import ConfigError
from jaxrat.tasks.base import load_task
from jaxrat.trainer.early_stop import EarlyStop
from runner import read_metrics, run_main


def _stopper(**train):
    config = load_config("configs/isic.py:smoke")
    with config.unlocked():
        for k, v in train.items():
            config.train[k] = v
    return EarlyStop(config, load_task(config))


def test_patience_counts_evaluations_without_a_big_enough_improvement():
    es = _stopper(early_stop_patience=2, early_stop_min_delta=0.01)  # eval/dice, max (the smoke best metric)
    assert es.metric == "eval/dice" and es.mode == "max"
    assert not es.update(1, {"eval/dice": 0.5})
    assert not es.update(2, {"eval/dice": 0.505})  # within min_delta: no improvement
    assert not es.update(3, {"eval/dice": 0.6})  # improvement: the count restarts
    assert not es.update(4, {"eval/dice": 0.6})
    assert es.update(5, {"eval/dice": 0.59})
    assert "eval/dice" in es.stopped and "step 3" in es.stopped
    saved = es.state()
    again = _stopper(early_stop_patience=2, early_stop_min_delta=0.01)
    again.load(saved)
    assert again.stopped and again.best == 0.6 and again.bad == 2
    patient = _stopper(early_stop_patience=4, early_stop_min_delta=0.01)
    patient.load(saved)
    assert not patient.stopped and patient.bad == 2  # more patience continues the count


def test_a_loss_is_minimised_and_bad_settings_name_the_fix():
    es = _stopper(early_stop_patience=1, early_stop_metric="eval/loss", early_stop_mode="min")
    assert not es.update(1, {"eval/loss": 1.0})
    assert not es.update(2, {"eval/loss": 0.9})
    assert es.update(3, {"eval/loss": 0.95})
    assert _stopper().state() == {} and not _stopper().update(1, {"eval/dice": 0.0})
    with pytest.raises(ConfigError, match="early_stop_metric='eval/nope'"):
        _stopper(early_stop_patience=1, early_stop_metric="eval/nope")
    with pytest.raises(ConfigError, match="early_stop_mode"):
        _stopper(early_stop_patience=1, early_stop_metric="eval/loss", early_stop_mode="down")


@pytest.mark.slow
@pytest.mark.integration
def test_a_flat_run_stops_resumes_its_count_and_is_finished_for_the_sweep(tmp_path):
    wd = str(tmp_path / "flat")
    flat = ["--config.optimizer.learning_rate=0.0", "--config.train.eval_every=1", "--config.checkpoint.every_steps=1",
            "--config.train.early_stop_patience=3"]
    run_main(wd, *flat, "--config.num_train_steps=2")  # evals 1 (best), 2 (1 without improvement)
    meta = step_metadata(os.path.join(wd, "checkpoints"), 2)
    assert meta["early_stop"]["bad"] == 1 and not stopped_early(meta)
    assert not run_state(wd, 20).finished
    # Raised to 20 steps: evals 3 and 4 make three in a row, so it stops at 4 (a count restarted at
    # the resume would stop at 6).
    run_main(wd, *flat, "--config.num_train_steps=20")
    assert committed_steps(os.path.join(wd, "checkpoints"))[-1] == 4
    assert stopped_early(step_metadata(os.path.join(wd, "checkpoints"), 4))
    summary = json.load(open(os.path.join(wd, "summary.json")))
    assert summary["status"] == "finished" and summary["stopped_early"]["step"] == 4
    assert "has not improved" in summary["stopped_early"]["reason"]
    assert "Stopped early at step 4" in open(os.path.join(wd, "summary.md")).read()
    state = run_state(wd, 20)
    assert state.finished and state.describe() == "stopped early at step 4"
    trained = len([r for r in read_metrics(wd) if "train/loss" in r])
    proc = run_main(wd, *flat, "--config.num_train_steps=20")
    assert "nothing to do" in proc.stderr + proc.stdout
    assert len([r for r in read_metrics(wd) if "train/loss" in r]) == trained


def test_the_sweep_sees_a_stop_in_the_metadata_or_at_a_step_saved_before(tmp_path):
    from pathlib import Path

    from test_sweep import fake_checkpoint

    fake_checkpoint(Path(tmp_path, "meta"), 4)
    meta = Path(tmp_path, "meta", "checkpoints", "4", "_CHECKPOINT_METADATA")
    meta.write_text(json.dumps({"custom_metadata": {"early_stop": {"stopped": True}}}))
    assert run_state(str(tmp_path / "meta"), 20).describe() == "stopped early at step 4"
    # Preempted in its evaluation at step 4, resumed, stopped there: the checkpoint was saved before.
    fake_checkpoint(Path(tmp_path, "pending"), 4, eval_pending=True)
    assert not run_state(str(tmp_path / "pending"), 20).finished
    Path(tmp_path, "pending", "summary.json").write_text(json.dumps({"stopped_early": {"step": 4}}))
    assert run_state(str(tmp_path / "pending"), 20).finished
    Path(tmp_path, "pending", "summary.json").write_text(json.dumps({"stopped_early": {"step": 2}}))
    assert not run_state(str(tmp_path / "pending"), 20).finished


def test_a_patience_the_run_is_too_short_for_is_warned_about(caplog):
    """Nothing said so: a run of 6 steps evaluating every 3 (2 evaluations) can never stop with
    patience 2, and the user believed early stopping guarded it."""
    import logging

    with caplog.at_level(logging.WARNING):
        _stopper(early_stop_patience=1)  # the smoke config: 6 steps, an evaluation every 3: it can stop
    assert "cannot trigger" not in caplog.text
    with caplog.at_level(logging.WARNING):
        _stopper(early_stop_patience=2)
    assert "early stopping cannot trigger in this run: it evaluates 2 times" in caplog.text


def test_a_nan_before_any_checkpoint_does_not_point_at_one():
    """It said "the last good checkpoint (step None in ...) is kept"."""
    import numpy as np

    from jaxrat.trainer.hooks import TrainingDiverged, TrainLog

    log = TrainLog(None, None, total_steps=10, every=1, last_good=lambda: "")
    with pytest.raises(TrainingDiverged, match="before any checkpoint was saved, so there is nothing to resume"):
        log.add(1, {"train/nonfinite": np.int32(1), "train/loss": np.float32("nan")})
    log = TrainLog(None, None, total_steps=10, every=1, last_good=lambda: "step 4 in /w/checkpoints")
    with pytest.raises(TrainingDiverged, match=r"last good checkpoint \(step 4 in /w/checkpoints\) is kept"):
        log.add(5, {"train/nonfinite": np.int32(1), "train/loss": np.float32("nan")})
