"""Weights & Biases, offline by default: the run is written under ``WORKDIR/wandb`` and can be
uploaded later with ``wandb sync WORKDIR/wandb/offline-run-*`` from a machine that has network.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from typing import Any, Mapping

import numpy as np

from jaxrat.config_schema import default, field
from jaxrat.runtime.errors import ConfigError
from jaxrat.runtime.fileio import write_json
from jaxrat.tracking.base import TrackerBase

STATUS_EXIT_CODE = {"finished": 0, "failed": 1, "preempted": 1, "interrupted": 1}


class WandbTracker(TrackerBase):
    """Scalars, images, the config and the run's summary files in a W&B run (``tracking.wandb_mode``)."""

    name = "wandb"

    def __init__(self, workdir: str, tracking: Any) -> None:
        try:
            import wandb
        except ImportError:
            raise ConfigError("config.tracking.backends includes 'wandb' but the wandb package is not installed; "
                              "run pip install 'jaxrat[tracking]'.") from None
        self._wandb = wandb
        mode = tracking.get("wandb_mode") or default("tracking.wandb_mode")  # checked by writers.check_tracking
        # The same W&B run id across resumes of this workdir.
        id_file = os.path.join(workdir, "wandb_run.json")
        try:
            with open(id_file) as f:
                run_id = json.load(f)["run_id"]
        except (OSError, ValueError, KeyError):
            run_id = uuid.uuid4().hex[:12]
            write_json(id_file, {"run_id": run_id})
        tags = [f"{k}={v}" for k, v in tuple(field(tracking, "tracking.tags"))]
        self._run = wandb.init(
            project=tracking.get("wandb_project") or default("tracking.wandb_project"),
            entity=field(tracking, "tracking.wandb_entity") or None,
            name=field(tracking, "tracking.run_name") or os.path.basename(os.path.normpath(workdir)), id=run_id,
            resume="allow", dir=workdir, mode=mode, tags=tags,
            settings=wandb.Settings(console="off", x_disable_stats=True, silent=True),
        )
        self.run_dir = self._run.dir

    def log_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
        self._run.log(dict(scalars), step=int(step))

    def log_images(self, step: int, images: Mapping[str, np.ndarray]) -> None:
        as_bytes = {k: (np.clip(np.asarray(v), 0, 1) * 255).astype(np.uint8) for k, v in images.items()}
        self._run.log({k: [self._wandb.Image(x) for x in v] for k, v in as_bytes.items()}, step=int(step))

    def log_hparams(self, hparams: Mapping[str, Any]) -> None:
        self._run.config.update(dict(hparams), allow_val_change=True)

    def log_artifact(self, path: str) -> None:
        # A copy in the run's folder (not W&B's symlink, which would follow later rewrites of the file).
        copy = os.path.join(self._run.dir, os.path.basename(path))
        shutil.copyfile(path, copy)
        self._run.save(copy, base_path=self._run.dir, policy="now")

    def log_reference(self, name: str, path: str) -> None:
        self._run.summary[name] = path

    def close(self, status: str = "finished") -> None:
        self._run.finish(exit_code=STATUS_EXIT_CODE.get(status, 0))
