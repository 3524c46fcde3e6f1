"""Trackers behind MetricWriter: a failing one costs a warning, never the run; what each writes."""

import glob
import logging
import os

import ml_collections as mlc
import numpy as np
import pytest

from jaxrat.runtime.errors import ConfigError
from jaxrat.tracking.base import TrackerBase, flatten
from jaxrat.tracking.writers import MetricWriter, check_tracking, open_trackers


class Recorder(TrackerBase):
    name = "recorder"

    def __init__(self):
        self.calls = []

    def log_scalars(self, step, scalars):
        self.calls.append(("scalars", step, dict(scalars)))

    def log_images(self, step, images):
        self.calls.append(("images", step, sorted(images)))

    def log_hparams(self, hparams):
        self.calls.append(("hparams", dict(hparams)))

    def log_reference(self, name, path):
        self.calls.append(("reference", name, path))

    def close(self, status="finished"):
        self.calls.append(("close", status))


class Flaky(TrackerBase):
    """Fails (server away, disk full) while ``broken``; counts the calls that reached it."""

    name = "flaky"

    def __init__(self):
        self.broken, self.written, self.tried = True, [], 0

    def log_scalars(self, step, scalars):
        self.tried += 1
        if self.broken:
            raise ConnectionError("Connection refused") if step % 2 else OSError(28, "No space left on device")
        self.written.append(step)

    def log_images(self, step, images):
        raise ConnectionError("server went away")

    def close(self, status="finished"):
        raise OSError(5, "Input/output error")


def test_a_failing_tracker_warns_once_and_the_others_get_every_call(caplog):
    good, flaky = Recorder(), Flaky()
    writer = MetricWriter("/nonexistent", is_main=True, trackers=[flaky, good])
    with caplog.at_level(logging.WARNING):
        for step in range(1, 5):
            writer.write_scalars(step, {"train/loss": 1.0 / step})
        writer.write_images(4, {"eval/input": np.zeros((1, 2, 2, 3))})
        flaky.broken = False
        writer.write_scalars(5, {"train/loss": 0.2})
        writer.write_hparams({"optimizer": {"learning_rate": 1e-3}, "mesh": {"axes": (("data", -1),)}})
        writer.log_reference("checkpoint/last", "/w/checkpoints/5")
        writer.close("preempted")
    assert [c[1] for c in good.calls if c[0] == "scalars"] == [1, 2, 3, 4, 5]
    assert ("images", 4, ["eval/input"]) in good.calls
    assert ("hparams", {"optimizer.learning_rate": 1e-3, "mesh.axes": "(('data', -1),)"}) in good.calls
    assert good.calls[-2:] == [("reference", "checkpoint/last", "/w/checkpoints/5"), ("close", "preempted")]
    assert flaky.tried == 5 and flaky.written == [5]  # tried again at every call, and written once it worked
    # One warning when it started failing (scalars and images alike), one when it wrote again, one at close.
    assert caplog.text.count("flaky: cannot write") == 2
    assert "Connection refused" in caplog.text and "flaky: writing again" in caplog.text


def test_processes_other_than_0_open_no_tracker(tmp_path):
    writer = MetricWriter(str(tmp_path), is_main=False, tracking=mlc.ConfigDict({"backends": ("jsonl",)}))
    writer.write_scalars(1, {"a": 1.0})
    writer.close()
    assert os.listdir(tmp_path) == []


def test_unknown_backend_and_missing_package_are_one_sentence(monkeypatch):
    with pytest.raises(ConfigError, match="unknown backends"):
        check_tracking(mlc.ConfigDict({"backends": ("tensorboard", "neptune")}))
    with pytest.raises(ConfigError, match="wandb_mode='ofline'"):
        check_tracking(mlc.ConfigDict({"backends": ("wandb",), "wandb_mode": "ofline"}))
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(ConfigError, match=r"pip install 'jaxrat\[tracking\]'"):
        open_trackers("/nonexistent", mlc.ConfigDict({"backends": ("jsonl", "mlflow")}))


def test_a_tracker_that_cannot_start_is_left_out_with_a_warning(tmp_path, caplog):
    blocker = tmp_path / "tensorboard"
    blocker.write_text("a file where the folder should be")
    trackers = open_trackers(str(tmp_path), mlc.ConfigDict({"backends": ("tensorboard", "jsonl")}))
    assert [t.name for t in trackers] == [str(tmp_path / "metrics.jsonl")]
    assert "tensorboard: cannot start" in caplog.text


def test_tensorboard_gets_scalars_images_and_the_config(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = MetricWriter(str(tmp_path), is_main=True)
    writer.write_hparams({"optimizer": {"learning_rate": 0.003}, "model": {"name": "rat"}})
    writer.write_scalars(2, {"train/learning_rate": 0.003, "train/device_memory_gb": 1.5})
    writer.write_images(2, {"eval/overlay": np.ones((2, 4, 4, 3))})
    writer.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0, "images": 0}).Reload()
    tags = acc.Tags()
    assert {"train/learning_rate", "train/device_memory_gb"} <= set(tags["scalars"])
    assert [(e.step, e.width, e.height) for e in acc.Images("eval/overlay")] == [(2, 8, 4)]  # tiled side by side
    assert "_hparams_/session_start_info" in acc.PluginTagToContent("hparams")  # the HParams dashboard
    text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "| optimizer.learning_rate | 0.003 |" in text
    assert '"train/learning_rate": 0.003' in (tmp_path / "metrics.jsonl").read_text()


def test_device_memory_is_logged_where_the_backend_reports_it(monkeypatch):
    import jax

    from jaxrat.trainer.hooks import device_memory

    assert device_memory() == {}  # CPU devices report nothing

    class Gpu:
        def __init__(self, used):
            self.used = used

        def memory_stats(self):
            return {"bytes_in_use": self.used, "peak_bytes_in_use": 2 * self.used}

    monkeypatch.setattr(jax, "local_devices", lambda: [Gpu(2**30), Gpu(3 * 2**30)])
    assert device_memory() == {"train/device_memory_gb": 3.0, "train/device_peak_memory_gb": 6.0}


def test_flatten_keeps_scalars_and_spells_out_the_rest():
    assert flatten({"a": {"b": 1, "c": {"d": "x"}}, "e": [1, 2], "f": None}) == \
        {"a.b": 1, "a.c.d": "x", "e": "[1, 2]", "f": None}


def test_mlflow_with_no_server_never_stops_the_caller(tmp_path, caplog, monkeypatch):
    """Port 1 refuses connections: every call fails in the background thread, the caller only enqueues."""
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    from jaxrat.tracking import mlflow as mlflow_tracker

    monkeypatch.setattr(mlflow_tracker, "PAUSE_S", 3600.0)
    tracking = mlc.ConfigDict({"backends": ("mlflow",), "mlflow_uri": "http://127.0.0.1:1", "queue_size": 8,
                               "close_timeout_s": 60.0})
    writer = MetricWriter(str(tmp_path), is_main=True, tracking=tracking)
    with caplog.at_level(logging.WARNING):
        writer.write_hparams({"a": 1})
        for step in range(50):  # more than the queue holds: the rest are dropped, not waited for
            writer.write_scalars(step, {"train/loss": 1.0})
        writer.close("finished")
    assert caplog.text.count("mlflow: cannot write") == 1
    assert "calls failed in a row" in caplog.text and "logs were dropped" in caplog.text
    assert not os.path.exists(tmp_path / "mlflow_run.json")
    assert not glob.glob(str(tmp_path / "*.db"))


def test_the_segmentation_overlay_tints_truth_green_and_prediction_red():
    from jaxrat.tasks.segmentation import overlay

    image = np.full((1, 1, 4, 3), 0.5)
    truth = np.array([True, True, False, False]).reshape(1, 1, 4, 1)
    pred = np.array([True, False, True, False]).reshape(1, 1, 4, 1)
    out = overlay(image, truth, pred)[0, 0]
    np.testing.assert_allclose(out, [[0.75, 0.75, 0.25], [0.25, 0.75, 0.25], [0.75, 0.25, 0.25], [0.5, 0.5, 0.5]])


def test_mlflow_default_store_is_in_the_workdir_and_a_resume_continues_its_run(tmp_path, monkeypatch, caplog):
    pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    from mlflow.tracking import MlflowClient

    tracking = mlc.ConfigDict({"backends": ("mlflow",), "mlflow_uri": "", "experiment": "e", "run_name": "",
                               "tags": (("team", "rat"),)})
    for steps in (2, 3):  # the first run, then its resume with one more step
        writer = MetricWriter(str(tmp_path), is_main=True, tracking=tracking)
        writer.write_hparams({"num_train_steps": steps, "seed": 0})
        for step in range(1, steps + 1):
            writer.write_scalars(step, {"train/loss": 1.0 / step})
        (tmp_path / "summary.json").write_text('{"steps": %d}' % steps)
        writer.log_artifact(str(tmp_path / "summary.json"))
        writer.log_reference("checkpoint/last", f"/w/checkpoints/{steps}")
        writer.close()
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("e").experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == tmp_path.name and run.data.tags["team"] == "rat"
    assert run.data.params == {"num_train_steps": "2", "seed": "0"}  # MLflow keeps a param's first value
    assert "num_train_steps changed on resume" in caplog.text
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/loss")] == \
        [(1, 1.0), (2, 0.5), (1, 1.0), (2, 0.5), (3, pytest.approx(1 / 3))]
    assert run.data.tags["checkpoint/last"] == "/w/checkpoints/3"
    (stored,) = glob.glob(str(tmp_path / "mlflow_artifacts" / "*" / "artifacts" / "summary.json"))
    assert open(stored).read() == '{"steps": 3}'


def test_the_tensorboard_writer_does_not_import_torch_and_leaves_an_imported_one(tmp_path):
    """tensorboardX imports torch when it can (~1 s of every run's start where the reference extra
    is installed); jaxrat's writer blocks that, and only when torch was not imported already."""
    import subprocess
    import sys

    probe = ("import sys\n{pre}from jaxrat.tracking.tensorboard import TensorBoardTracker\n"
             "TensorBoardTracker(sys.argv[1]).log_scalars(1, {{'x': 1.0}})\n"
             "print('torch' in sys.modules and sys.modules['torch'] is not None)\n")
    plain = subprocess.run([sys.executable, "-c", probe.format(pre=""), str(tmp_path / "a")], capture_output=True,
                           text=True, timeout=120)
    assert plain.returncode == 0 and plain.stdout.strip() == "False", plain.stderr[-2000:]
    assert glob.glob(str(tmp_path / "a" / "tensorboard" / "events.*"))
    pytest.importorskip("torch")
    kept = subprocess.run([sys.executable, "-c", probe.format(pre="import torch\n"), str(tmp_path / "b")],
                          capture_output=True, text=True, timeout=120)
    assert kept.returncode == 0 and kept.stdout.strip() == "True", kept.stderr[-2000:]
