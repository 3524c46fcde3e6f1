"""Trackers in real training runs: the run summary, W&B offline, and a real MLflow server that dies mid-run."""

import contextlib
import glob
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from runner import REPO, env_with_devices, main_cmd, read_metrics, run_main


def wandb_records(path: str) -> list:
    """The records of a W&B run file (a LevelDB-style log of protobuf records after a 7-byte header)."""
    from wandb.proto import wandb_internal_pb2 as pb

    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B"
    block, pos, raw, pending = 32768, 7, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:  # full
            raw.append(chunk)
        elif kind == 2:  # first
            pending = chunk
        elif kind == 3:  # middle
            pending += chunk
        elif kind == 4:  # last
            raw.append(pending + chunk)
    records = []
    for r in raw:
        record = pb.Record()
        record.ParseFromString(r)
        records.append(record)
    return records


def _items(items) -> dict:
    return {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}


def test_summary_and_wandb_offline_after_a_smoke_run(tmp_path):
    pytest.importorskip("wandb")
    w = str(tmp_path / "run")
    run_main(w, "--config.tracking.backends=('tensorboard','jsonl','wandb')", "--config.train.log_images=True",
             devices=2)
    rows = read_metrics(w)
    evals = [r for r in rows if "eval/dice" in r]
    best = max(evals, key=lambda r: r["eval/dice"])

    with open(os.path.join(w, "summary.json")) as f:
        s = json.load(f)
    assert s["status"] == "finished" and s["steps"] == {"first": 0, "last": 6, "total": 6, "run": 6}
    assert s["hardware"]["device_count"] == 2 and s["mesh"] == {"data": 2, "fsdp": 1}
    assert s["compute_dtype"] == "float32" and s["config"]["train"]["compute_dtype"] == "auto"  # resolved on CPU
    assert s["wall_time_s"] > 0 and s["images_per_sec"] > 0 and s["global_batch"] == 8
    assert s["last_eval"]["eval/dice"] == pytest.approx(evals[-1]["eval/dice"])
    assert s["last_train"]["train/loss"] == pytest.approx([r for r in rows if "train/loss" in r][-1]["train/loss"])
    assert "train/learning_rate" in s["last_train"] and "train/examples_per_sec" in s["last_train"]
    assert (s["best"]["step"], s["best"]["value"]) == (best["step"], pytest.approx(best["eval/dice"]))
    ckpt = os.path.join(w, "checkpoints")
    assert s["checkpoints"]["last"] == os.path.join(ckpt, "6")
    assert s["checkpoints"]["best"] == os.path.join(ckpt, str(best["step"]))
    assert s["config"]["num_train_steps"] == 6 and s["config"]["model"]["name"] == "unet"
    md = open(os.path.join(w, "summary.md")).read()
    assert "Status: **finished**" in md and f"eval/dice {best['eval/dice']:.4g} at step {best['step']}" in md

    # W&B offline: every logged train loss, the config, eval images and the summary file.
    (run_file,) = glob.glob(os.path.join(w, "wandb", "offline-run-*", "run-*.wandb"))
    records = wandb_records(run_file)
    history = [_items(r.history.item) for r in records if r.WhichOneof("record_type") == "history"]
    logged = {h["_step"]: h["train/loss"] for h in history if "train/loss" in h}
    assert logged == pytest.approx({r["step"]: r["train/loss"] for r in rows if "train/loss" in r})
    config = {}
    for r in records:
        if r.WhichOneof("record_type") == "config":
            config.update(_items(r.config.update))
    assert config["optimizer.learning_rate"] == pytest.approx(1e-3) and config["model.name"] == "unet"
    files_dir = os.path.join(os.path.dirname(run_file), "files")
    assert glob.glob(os.path.join(files_dir, "media", "images", "eval", "overlay_*.png"))
    assert json.load(open(os.path.join(files_dir, "summary.json")))["status"] == "finished"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def mlflow_server(root: str):
    """A real ``mlflow server`` on 127.0.0.1 with a sqlite store; yields (url, kill)."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [os.path.join(os.path.dirname(sys.executable), "mlflow"), "server",
           "--backend-store-uri", f"sqlite:///{root}/mlflow.db", "--artifacts-destination", f"{root}/artifacts",
           "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    log_path = os.path.join(root, "server.log")
    # No job runner: its worker processes would each import mlflow, for jobs no test submits.
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=root, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)

    def kill() -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)

    try:
        deadline = time.monotonic() + 240  # the server imports a lot; a busy 2-core machine needs time
        while True:
            with contextlib.suppress(OSError):
                if urllib.request.urlopen(url + "/health", timeout=5).status == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"mlflow server did not start:\n{open(log_path).read()[-3000:]}")
            time.sleep(0.5)
        yield url, kill
    finally:
        kill()


def test_mlflow_server_gets_params_and_metrics_and_its_death_costs_only_a_warning(tmp_path):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    with mlflow_server(str(tmp_path)) as (url, kill):
        tracking = ["--config.tracking.backends=('jsonl','mlflow')", f"--config.tracking.mlflow_uri={url}",
                    "--config.tracking.experiment=jaxrat-test"]
        w = str(tmp_path / "run1")
        run_main(w, *tracking, "--config.train.plots=true")  # the smoke variant draws none by default
        client = MlflowClient(url)
        run_id = json.load(open(os.path.join(w, "mlflow_run.json")))["run_id"]
        run = client.get_run(run_id)
        assert run.info.status == "FINISHED" and run.info.run_name == "run1"
        assert client.get_experiment(run.info.experiment_id).name == "jaxrat-test"
        assert run.data.params["optimizer.learning_rate"] == "0.001" and run.data.params["model.name"] == "unet"
        rows = read_metrics(w)
        history = {m.step: m.value for m in client.get_metric_history(run_id, "train/loss")}
        assert history == pytest.approx({r["step"]: r["train/loss"] for r in rows if "train/loss" in r})
        assert [m.step for m in client.get_metric_history(run_id, "eval/dice")] == [3, 6]
        assert "train/learning_rate" in run.data.metrics and "train/examples_per_sec" in run.data.metrics
        assert run.data.tags["checkpoint/last"] == os.path.join(w, "checkpoints", "6")
        assert run.data.tags["checkpoint/best"].startswith(os.path.join(w, "checkpoints"))
        assert {a.path for a in client.list_artifacts(run_id)} == {"summary.json", "summary.md", "curves.png"}

        # The server dies once the second run has logged its first step; the run still finishes.
        w2 = str(tmp_path / "run2")
        out = open(tmp_path / "run2.log", "w")
        proc = subprocess.Popen(main_cmd(w2, *tracking, "--config.num_train_steps=60", "--config.train.eval_every=30",
                                         "--config.checkpoint.every_steps=30"),
                                env=env_with_devices(1), cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        try:
            metrics = os.path.join(w2, "metrics.jsonl")
            deadline = time.monotonic() + 240
            while not (os.path.exists(os.path.join(w2, "mlflow_run.json")) and os.path.exists(metrics)
                       and os.path.getsize(metrics) > 0):
                assert proc.poll() is None and time.monotonic() < deadline, open(tmp_path / "run2.log").read()[-3000:]
                time.sleep(0.1)
            kill()
            killed_at = time.time()
            rc = proc.wait(timeout=300)
        finally:
            proc.kill()
            proc.wait()
    log = open(tmp_path / "run2.log").read()
    assert rc == 0, log[-3000:]
    assert "mlflow: cannot write" in log
    rows = read_metrics(w2)
    assert [r["step"] for r in rows if "train/loss" in r] == list(range(1, 61))
    assert any(r["time"] > killed_at for r in rows if "train/loss" in r)  # the server died mid-run
    assert json.load(open(os.path.join(w2, "summary.json")))["status"] == "finished"
