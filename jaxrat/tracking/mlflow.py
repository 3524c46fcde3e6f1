"""MLflow: params, metrics per step, tags, the run's summary files and its checkpoint paths.

Every MLflow call runs in one background thread fed by a bounded queue, so a slow or dead server
never stalls a training step: when the queue is full, logs are dropped (they stay in
``metrics.jsonl``); after a few failed calls in a row the thread pauses, drops what comes, and
tries again later. The run id is kept in ``WORKDIR/mlflow_run.json`` so a resumed run continues
the same MLflow run.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import socket
import threading
import time
from typing import Any, Callable, Mapping

from jaxrat.config_schema import default, field
from jaxrat.runtime.errors import ConfigError
from jaxrat.runtime.fileio import write_json
from jaxrat.tracking.base import Guard, TrackerBase, describe

# Fail fast: the client's defaults (120 s timeout, 7 retries with backoff) would hold the thread,
# and the end of the run, for many minutes per call once the server is gone.
HTTP_ENV = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "10", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
            "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}
FAILURES_BEFORE_PAUSE = 3
PAUSE_S = 60.0
MAX_PARAMS_PER_CALL = 100  # the server's limit for log_batch
MAX_PARAM_LENGTH = 6000
STATUS = {"finished": "FINISHED", "failed": "FAILED", "preempted": "KILLED", "interrupted": "KILLED"}


def _require_mlflow() -> None:
    try:
        import mlflow  # noqa: F401
    except ImportError:
        raise ConfigError("config.tracking.backends includes 'mlflow' but the mlflow package is not installed; "
                          "run pip install 'jaxrat[tracking]'.") from None


class MLflowTracker(TrackerBase):
    """Logs to the MLflow server at ``tracking.mlflow_uri`` (empty: ``$MLFLOW_TRACKING_URI``)."""

    name = "mlflow"

    def __init__(self, workdir: str, tracking: Any) -> None:
        _require_mlflow()
        for k, v in HTTP_ENV.items():
            os.environ.setdefault(k, v)
        # Every refused connection would log its own retry line; the guard's one warning says it all.
        logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)
        # Empty: $MLFLOW_TRACKING_URI, else a database in the workdir (mlflow's own default is the
        # current directory, which on a cluster is wherever the job happened to start).
        self.uri = field(tracking, "tracking.mlflow_uri") or os.environ.get("MLFLOW_TRACKING_URI", "")
        # The workdir's own database keeps its artifacts beside it, not in the current directory.
        self._artifacts = None if self.uri else os.path.join(workdir, "mlflow_artifacts")
        self.uri = self.uri or "sqlite:///" + os.path.join(workdir, "mlflow.db")
        self.experiment = tracking.get("experiment") or default("tracking.experiment")
        self.run_name = field(tracking, "tracking.run_name") or os.path.basename(os.path.normpath(workdir))
        self.tags = {str(k): str(v) for k, v in tuple(field(tracking, "tracking.tags"))}
        self.tags.update({"jaxrat.workdir": workdir, "jaxrat.host": socket.gethostname()})
        self.close_timeout_s = float(field(tracking, "tracking.close_timeout_s"))
        self._id_file = os.path.join(workdir, "mlflow_run.json")
        self._mlflow_client = None  # made in the thread: opening a database may take seconds
        self.run_id: str | None = None
        self._resumed = False
        self._queue: queue.Queue = queue.Queue(maxsize=int(field(tracking, "tracking.queue_size")))
        self._guard = Guard()
        self._failures, self._paused_until, self._dropped = 0, 0.0, 0
        self._thread = threading.Thread(target=self._work, name="jaxrat-mlflow", daemon=True)
        self._thread.start()
        self._submit(self._ensure_run)

    # ------------------------------------------------------------------ main thread: enqueue only
    def _submit(self, fn: Callable[[], Any]) -> None:
        try:
            self._queue.put_nowait(fn)
        except queue.Full:
            if not self._dropped:
                logging.warning("mlflow: the server does not keep up; dropping logs (metrics.jsonl keeps them)")
            self._dropped += 1

    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now, int(step)) for k, v in scalars.items()]
        self._submit(lambda: self._client.log_batch(self._ensure_run(), metrics=metrics))

    def log_hparams(self, hparams: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        params = [Param(k, str(v)[:MAX_PARAM_LENGTH]) for k, v in sorted(hparams.items())]
        self._submit(lambda: self._log_params(params))

    def _log_params(self, params: list) -> None:
        run_id = self._ensure_run()
        # A resumed run's params are there already; MLflow refuses to change one (e.g. num_train_steps).
        known = self._client.get_run(run_id).data.params if self._resumed else {}
        changed = [p.key for p in params if p.key in known and known[p.key] != p.value]
        if changed:
            logging.warning("mlflow: %s changed on resume; the MLflow run keeps the first values", ", ".join(changed))
        fresh = [p for p in params if p.key not in known]
        for i in range(0, len(fresh), MAX_PARAMS_PER_CALL):
            self._client.log_batch(run_id, params=fresh[i:i + MAX_PARAMS_PER_CALL])

    def log_artifact(self, path: str) -> None:
        self._submit(lambda: self._client.log_artifact(self._ensure_run(), path))

    def log_reference(self, name: str, path: str) -> None:
        # A tag, not an upload: checkpoints are gigabytes and already on the cluster's filesystem.
        self._submit(lambda: self._client.set_tag(self._ensure_run(), name, path))

    def close(self, status: str = "finished") -> None:
        """End the run, then wait at most ``tracking.close_timeout_s`` for the queue to drain."""
        self._submit(lambda: self._client.set_terminated(self._ensure_run(), STATUS.get(status, "FINISHED")))
        deadline = time.monotonic() + self.close_timeout_s
        try:
            self._queue.put(None, timeout=self.close_timeout_s)
        except queue.Full:
            pass  # the thread is a daemon: it dies with the process
        self._thread.join(timeout=max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            logging.warning("mlflow: %d logs not sent within %.0f s at the end of the run; giving up on them",
                            self._queue.qsize(), self.close_timeout_s)
        elif self._dropped:
            logging.warning("mlflow: %d logs were dropped while the server was slow or away", self._dropped)

    # ------------------------------------------------------------------ background thread
    def _work(self) -> None:
        while True:
            fn = self._queue.get()
            if fn is None:
                return
            if time.monotonic() < self._paused_until:
                self._dropped += 1
                continue
            if self._guard.call("mlflow", fn):
                self._failures = 0
                continue
            self._failures += 1
            if self._failures >= FAILURES_BEFORE_PAUSE:
                logging.warning("mlflow: %d calls failed in a row; dropping its logs for %.0f s, then trying again",
                                self._failures, PAUSE_S)
                self._paused_until, self._failures = time.monotonic() + PAUSE_S, 0

    @property
    def _client(self) -> Any:
        if self._mlflow_client is None:
            from mlflow.tracking import MlflowClient

            self._mlflow_client = MlflowClient(self.uri)
        return self._mlflow_client

    def _ensure_run(self) -> str:
        """The MLflow run id: this workdir's earlier run on the same server, else a new run."""
        if self.run_id is not None:
            return self.run_id
        previous = self._read_id_file()
        if previous:
            try:
                self._client.get_run(previous)
                self._client.update_run(previous, status="RUNNING")
                self.run_id, self._resumed = previous, True
                logging.info("mlflow: continuing run %s", previous)
                return previous
            except Exception as e:  # deleted on the server, or another server: start a new run
                logging.info("mlflow: cannot continue run %s (%s); starting a new one", previous, describe(e))
        exp = self._client.get_experiment_by_name(self.experiment)
        exp_id = (exp.experiment_id if exp is not None
                  else self._client.create_experiment(self.experiment, artifact_location=self._artifacts))
        run = self._client.create_run(exp_id, run_name=self.run_name, tags=self.tags)
        self.run_id = run.info.run_id
        write_json(self._id_file, {"tracking_uri": self.uri, "experiment_id": exp_id, "run_id": self.run_id})
        logging.info("mlflow: run %s in experiment %r at %s", self.run_id, self.experiment, self.uri)
        return self.run_id

    def _read_id_file(self) -> str:
        try:
            with open(self._id_file) as f:
                saved = json.load(f)
        except (OSError, ValueError):
            return ""
        return saved.get("run_id", "") if saved.get("tracking_uri") == self.uri else ""
