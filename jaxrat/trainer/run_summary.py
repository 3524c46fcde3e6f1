"""What a finished (or preempted) run leaves for people: ``summary.json`` and ``summary.md``.

Config, hardware and mesh, steps, wall time, images/s, best and last metrics, checkpoint paths.
Process 0 writes the files and hands them (and the checkpoint paths) to the trackers.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import subprocess
import time
from typing import Any, Sequence

import jax
import ml_collections as mlc

from jaxrat.checkpointing import store
from jaxrat.config_schema import field
from jaxrat.tracking.summary import write_summary
from jaxrat.tracking.writers import MetricWriter


def hardware(mesh: jax.sharding.Mesh) -> dict[str, Any]:
    """The devices and processes this run used."""
    devices = jax.devices()
    return {"backend": jax.default_backend(), "device_kind": devices[0].device_kind, "device_count": len(devices),
            "local_device_count": jax.local_device_count(), "process_count": jax.process_count(),
            "host": socket.gethostname(), "mesh": {str(k): int(v) for k, v in mesh.shape.items()}}


def code_version() -> dict[str, Any]:
    """The jaxrat source this run trained with: its git commit and whether the checkout had
    uncommitted changes (None outside a git checkout), and the installed package version."""
    from importlib import metadata

    here = os.path.dirname(os.path.abspath(__file__))
    out: dict[str, Any] = {"commit": None, "dirty": None, "version": None}
    try:
        out["version"] = metadata.version("jaxrat")
    except metadata.PackageNotFoundError:
        pass
    try:
        git = ["git", "-C", here]
        out["commit"] = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                                       check=True).stdout.strip() or None
        status = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                text=True, timeout=10, check=True).stdout
        out["dirty"] = bool(status.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return out


def checkpoints(directory: str) -> dict[str, Any]:
    """Paths of the last and best committed checkpoints (best: ``checkpoint.best_metric`` ranked)."""
    steps = store.committed_steps(directory)
    out: dict[str, Any] = {"directory": directory, "steps": steps,
                           "last": os.path.join(directory, str(steps[-1])) if steps else None, "best": None}
    best = store.best_step(directory)
    if best is not None:
        out["best"] = os.path.join(directory, str(best[0]))
        out["best_pointer"] = best[1]
    return out


def best_of_run(this_part: dict[str, Any] | None, ck: dict[str, Any]) -> dict[str, Any] | None:
    """The run's best: the checkpoints' own pointer (``best.json``, over every part of a resumed run)
    when there is one, else the best eval of this part (``this_part``), which a resume forgets."""
    pointer = ck.get("best_pointer")
    if pointer and "value" in pointer:
        return {k: pointer[k] for k in ("metric", "mode", "value", "step") if k in pointer}
    return this_part


def kernels_summary(config: mlc.ConfigDict, kernels: Any) -> dict[str, Any]:
    """The resolved kernel policy as the summary records it: on the gpu form, the fused forms used and
    those held back (:mod:`jaxrat.ops.forms`)."""
    from jaxrat.ops.forms import candidates

    out = {"configured": field(config.model, "model.kernels"), **dataclasses.asdict(kernels)}
    if kernels.gpu:
        out["gpu_forms_requested"] = str(field(config.model, "model.gpu_forms"))
        out["gpu_forms"] = sorted(kernels.gpu_forms)
        out["gpu_forms_held_back"] = sorted(candidates() - kernels.gpu_forms)
    else:
        out["gpu_forms"] = []
    return out


def build(config: mlc.ConfigDict, workdir: str, *, status: str, mesh: jax.sharding.Mesh, first: int, last: int,
          wall_time_s: float, images_per_sec: float | None, last_train: dict[str, float],
          last_eval: dict[str, float], best: dict[str, Any] | None, checkpoint_dir: str,
          last_eval_raw: dict[str, float] | None = None, stopped_early: dict[str, Any] | None = None,
          kernels: Any = None, compute_dtype: str | None = None, error: str | None = None) -> dict[str, Any]:
    """The summary's content (every process may call it; only process 0 writes it).

    ``last_eval_raw`` holds the raw parameters' ``eval_raw/*`` when ``last_eval`` is their moving
    average's; ``stopped_early`` says why early stopping ended the run; ``kernels`` is the run's
    resolved kernel policy and ``compute_dtype`` its resolved compute dtype; ``error`` why a failed run
    failed (its exception's type and first line)."""
    hw = hardware(mesh)
    ck = checkpoints(checkpoint_dir)
    return {
        "workdir": workdir, "status": status, **({"error": error} if error else {}),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "task": config.task.name, "model": config.model.name,
        "steps": {"first": first, "last": last, "total": config.num_train_steps, "run": last - first},
        "wall_time_s": wall_time_s, "images_per_sec": images_per_sec, "global_batch": config.data.batch_size,
        "hardware": hw, "mesh": hw["mesh"], "code": code_version(),
        "compute_dtype": compute_dtype,
        "kernels": None if kernels is None else kernels_summary(config, kernels),
        "last_train": last_train,
        "last_eval": {**{f"eval/{k}": v for k, v in last_eval.items()}, **(last_eval_raw or {})},
        "best": best_of_run(best, ck), "ema_decay": float(field(config.optimizer, "optimizer.ema_decay") or 0.0),
        "stopped_early": stopped_early,
        "checkpoints": ck,
        "config": json.loads(config.to_json_best_effort()),
    }


def draw(workdir: str, best_metric: str, confusions: dict[str, tuple[Any, list[str]]] | None,
         foreground: Sequence[str] = ()) -> list[str]:
    """The run's pictures (:mod:`jaxrat.tracking.plots`): the curves, and each confusion matrix; a
    picture that cannot be drawn costs a warning, never the summary."""
    from jaxrat.tracking import plots

    paths: list[str] = []
    try:
        curves = plots.write_curves(workdir, best_metric, foreground)
        paths += [curves] if curves else []
        for head, (matrix, labels) in (confusions or {}).items():
            paths.append(plots.write_confusion(workdir, head, matrix, labels))
    except Exception as e:  # matplotlib missing or failing must not cost the summary
        logging.warning("run summary: plots not drawn (%s: %s)", type(e).__name__, e)
    return paths


def publish(writer: MetricWriter, workdir: str, summary: dict[str, Any],
            confusions: dict[str, tuple[Any, list[str]]] | None = None, foreground: Sequence[str] = ()) -> None:
    """Draw the plots, write the files (process 0), hand them and the checkpoint paths to the
    trackers; a write that fails costs a warning. ``confusions``: {head: (matrix, class names)};
    ``foreground``: the classes whose curves are drawn (the task's ``curve_classes``)."""
    if jax.process_index() != 0:
        return
    config = summary.get("config") or {}
    best_metric = str(field(config.get("checkpoint", {}), "checkpoint.best_metric"))
    plots = field(config.get("train", {}), "train.plots")
    pictures = draw(workdir, best_metric, confusions, foreground) if plots else []
    summary = {**summary, "plots": [os.path.basename(p) for p in pictures]}
    try:
        paths = write_summary(workdir, summary) + pictures
    except OSError as e:
        logging.warning("run summary: cannot write it under %s (%s)", workdir, e.strerror or e)
        paths = []
    for path in paths:
        writer.log_artifact(path)
    for which in ("last", "best"):
        path = summary["checkpoints"].get(which)
        if path:
            writer.log_reference(f"checkpoint/{which}", path)
    if paths:
        logging.info("run summary: %s", paths[0])
