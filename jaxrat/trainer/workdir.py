"""One run per workdir, and no silent resume with another config (docs/workdir.md).

:func:`hold` wraps a training run. Process 0 takes ``WORKDIR/run.lock``
(:class:`~jaxrat.trainer.workdir_lock.WorkdirLock`) and checks the config against
``WORKDIR/config.json``; its verdict is broadcast, so every process of the run stops or proceeds
together. The lock is released when the run ends, however it ends.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import ml_collections as mlc
import numpy as np

from jaxrat.checkpointing.store import COMMIT_FILE, METADATA_FILE, split_spec
from jaxrat.config_schema import field
from jaxrat.data.badfiles import SKIPPED_FILES_NAME
from jaxrat.data.label_check import LABEL_STATS_NAME
from jaxrat.runtime import exit_guard, output_folder
from jaxrat.runtime.dotted import flatten
from jaxrat.runtime.errors import ConfigError, UserError
from jaxrat.runtime.fileio import move_into_place, read_json, unwritable, write_json, write_text
from jaxrat.tracking.plots import CURVES_NAME
from jaxrat.tracking.summary import JSON_NAME, MARKDOWN_NAME
from jaxrat.trainer.label_space import LABELS_NAME
from jaxrat.trainer.workdir_lock import WorkdirInUse, WorkdirLock

CONFIG_NAME = "config.json"
# The files a run writes at the top of its workdir besides config.json (the run summary, plots,
# metrics, the data checks' records, autotune's choice, the trackers' run ids, the label names), and its confusion
# matrices' prefix (confusion_<head>.png).
RUN_FILES = (JSON_NAME, MARKDOWN_NAME, CURVES_NAME, "metrics.jsonl", LABEL_STATS_NAME, SKIPPED_FILES_NAME,
             "autotune.json", "mlflow_run.json", "mlflow.db", "wandb_run.json", LABELS_NAME)
CONFUSION_PREFIX = "confusion_"
# Config fields that may change when a run resumes: the run's bounds, schedule of logs, evals,
# plots and checkpoints, where the data is read from and how fast, how the work is spread over
# devices and hosts, and where compiled programs are cached. Anything else changes what is trained
# (model, task, data, optimizer, seed, batch) and must match the checkpoint's config.json; a prefix
# ending in "." covers its whole section.
RESUMABLE = (
    "num_train_steps", "init_from", "init_from_include", "init_from_exclude", "init_from_strict",
    "init_from_rename", "train.log_every", "train.eval_every", "train.eval_at_end",
    "train.log_images", "train.plots", "train.compilation_cache_dir", "checkpoint.", "mesh.", "sharding.",
    "distributed.", "workdir.", "tracking.",
    "data.data_dir", "data.stage_to_local_dir", "data.num_threads", "data.prefetch_buffer",
    "data.device_prefetch", "data.num_workers", "data.worker_ram_budget_gb", "data.on_bad_file",
    "data.eval_batch_size", "data.eval_spacing", "optimizer.grad_accum_steps", "train.reduction_shards",
    "model.kernels",
)


class ConfigChanged(ConfigError):
    """A resume with a config that changes what is trained."""


# ------------------------------------------------------------------------------------ the config

def config_as_json(config: mlc.ConfigDict) -> dict[str, Any]:
    """The config as ``config.json`` holds it (tuples become lists), so the two compare equal."""
    return json.loads(config.to_json_best_effort(sort_keys=True))


def resumable(key: str) -> bool:
    """Whether the dotted config field ``key`` may change when a run resumes (:data:`RESUMABLE`)."""
    return any(key.startswith(p) if p.endswith(".") else key == p for p in RESUMABLE)


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(fields that change what is trained, fields that may change), as "key: old -> new".

    Only fields on both sides count: one present on one side only comes with a changed
    ``model.name``/``task.name`` (which is listed) or with a jaxrat version that added it.
    """
    a, b = flatten(old), flatten(new)
    fixed, free = [], []
    for key in sorted(a.keys() & b.keys()):
        if a[key] != b[key]:
            (free if resumable(key) else fixed).append(f"{key}: {json.dumps(a[key])} -> {json.dumps(b[key])}")
    return fixed, free


def _schedule_moves(old: dict[str, Any], new: dict[str, Any]) -> str:
    """"num_train_steps A -> B" when a resume changes the length its learning rate decays over, else ""."""
    a, b = old.get("num_train_steps"), new.get("num_train_steps")
    factor = (new.get("optimizer") or {}).get("end_learning_rate_factor", 0.0)
    if a is None or b is None or a == b or factor == 1.0:
        return ""
    return f"num_train_steps {a} -> {b}"


# What a save of jaxrat's writes into ``checkpoints/<step>/`` (Orbax's items and markers).
CHECKPOINT_ITEMS = frozenset({"state", "data", "metrics", METADATA_FILE, COMMIT_FILE})


def _step_folders(workdir: str) -> list[str]:
    """The folders of ``WORKDIR/checkpoints`` named by a number, in name order."""
    directory = os.path.join(workdir, "checkpoints")
    if not os.path.isdir(directory):
        return []
    return [p for p in (os.path.join(directory, n) for n in sorted(os.listdir(directory)) if n.isdigit())
            if os.path.isdir(p)]


def has_checkpoint(workdir: str) -> bool:
    """Whether ``WORKDIR/checkpoints`` holds a step of a run: a folder named by its number that is not
    another tool's (:func:`foreign_steps`)."""
    return any(not _foreign_step(path) for path in _step_folders(workdir))


def starts_from_itself(config: mlc.ConfigDict, workdir: str) -> str | None:
    """Why a new run cannot start: its ``init_from`` names its own ``workdir``, which has no checkpoint
    yet (a resume ignores init_from); None otherwise."""
    spec = str(config.get("init_from") or "")
    if not spec or has_checkpoint(workdir):
        return None
    path = os.path.realpath(os.path.expanduser(split_spec(spec)[0]))
    own = os.path.realpath(workdir)
    if path not in (own, os.path.join(own, "checkpoints")):
        return None
    return (f"--config.init_from={spec} names this run's own workdir, which has no checkpoint to start from; point "
            f"it at another run's workdir (whose weights start this one), or drop it.")


def foreign_steps(workdir: str) -> list[str]:
    """The numbered folders of ``WORKDIR/checkpoints`` that are another tool's checkpoints (a folder of
    yours used as the workdir): jaxrat saves its own steps there, and would set these aside as damaged."""
    return [path for path in _step_folders(workdir) if _foreign_step(path)]


def _foreign_step(path: str) -> bool:
    """Whether the numbered folder ``path`` holds files but none a jaxrat save writes."""
    names = set(os.listdir(path))
    return bool(names) and not names & CHECKPOINT_ITEMS


def check_and_save_config(config: mlc.ConfigDict, workdir: str, allow_change: bool) -> None:
    """Stop a resume whose config changes what is trained (:class:`ConfigChanged`), then write
    ``WORKDIR/config.json``; a different previous one is kept as ``config.<its UTC time>.json``."""
    check_config(config, workdir, allow_change)()


def check_config(config: mlc.ConfigDict, workdir: str, allow_change: bool) -> Callable[[], None]:
    """Stop a resume whose config changes what is trained (:class:`ConfigChanged`); return the
    function that writes ``WORKDIR/config.json`` (a different previous one kept aside as
    ``config.<its UTC time>.json``). Nothing is written before it is called."""
    path = os.path.join(workdir, CONFIG_NAME)
    new = config_as_json(config)
    old = None
    if os.path.exists(path):
        try:
            with open(path) as f:
                old = json.load(f)
        except ValueError as e:
            logging.warning("%s is unreadable (%s); it is kept aside and not compared", path, e)
    resuming = has_checkpoint(workdir)
    if old is not None and resuming:
        fixed, free = config_changes(old, new)
        if fixed and not allow_change:
            shown = "; ".join(fixed[:8]) + (f"; and {len(fixed) - 8} more" if len(fixed) > 8 else "")
            raise ConfigChanged(
                f"The workdir {workdir} holds checkpoints of a run with another config ({shown}): resume with its "
                f"config.json, start a new run in another --workdir (with --config.init_from={workdir} to load its "
                f"weights), or pass --config.workdir.allow_config_change=true to resume with these changes.")
        if fixed or free:  # operational changes are routine (a new port, more steps): worth a line, not a warning
            logging.log(logging.WARNING if fixed else logging.INFO, "resuming %s with a changed config (%s); the "
                        "previous config is kept aside", workdir, "; ".join(fixed + free))
        moved = _schedule_moves(old, new)
        if moved:
            logging.warning("%s: the learning rate's cosine decays over num_train_steps, so the resumed steps follow "
                            "the schedule of the new length, not the one the run had been following (the rate "
                            "changes at the resumed step); keep num_train_steps to continue the same schedule",
                            moved)
    elif resuming:
        logging.warning("%s has checkpoints but no readable %s to compare the config with", workdir, CONFIG_NAME)

    def save() -> None:
        # One guarded write: a quick exit (a second Ctrl-C during start-up) never falls between moving
        # the old config.json aside and writing the new one.
        with exit_guard.whole():
            if not resuming and (old is None or old != new):  # not an earlier attempt of this run: keep its files
                keep_aside_run_files(workdir)
            if os.path.exists(path) and (old is None or old != new):
                keep_aside(path)
            write_text(path, config.to_json_best_effort(indent=2, sort_keys=True))
    return save


def write_run_files(workdir: str, files: Mapping[str, Any]) -> None:
    """Write each of ``files`` (name -> JSON object) into ``workdir``; None is skipped, and a file that
    holds the object already is left as it is (a resume rewrites nothing it need not)."""
    for name, obj in files.items():
        path = os.path.join(workdir, name)
        if obj is not None and read_json(path) != obj:
            write_json(path, obj, indent=2)


def inside_dataset(config: mlc.ConfigDict, workdir: str) -> str | None:
    """Why ``workdir`` cannot hold a run of ``config``: it is or lies inside ``config.data.data_dir``
    (symlinks resolved), which jaxrat only reads, and checkpoints there would change it; None if apart."""
    data = config.get("data")
    data_dir = (data.get("data_dir") if data is not None else "") or ""
    how = output_folder.overlap(workdir, data_dir) if data_dir else ""
    if how not in ("is", "lies inside"):
        return None
    return (f"--workdir {workdir} {how} the dataset folder config.data.data_dir={data_dir}, which jaxrat only "
            "reads; choose a workdir outside it.")


def keep_aside(path: str) -> str:
    """Rename ``path`` (``NAME.EXT``) to ``NAME.<its UTC mtime>.EXT`` (``.1``, ``.2`` ... when taken); the new path."""
    folder, name = os.path.split(path)
    stem, ext = os.path.splitext(name)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(os.stat(path).st_mtime))
    aside, n = os.path.join(folder, f"{stem}.{stamp}{ext}"), 1
    while os.path.exists(aside):
        aside, n = os.path.join(folder, f"{stem}.{stamp}.{n}{ext}"), n + 1
    move_into_place(path, aside)
    return aside


def _run_file(name: str) -> bool:
    return name in RUN_FILES or (name.startswith(CONFUSION_PREFIX) and name.endswith(".png"))


def keep_aside_run_files(workdir: str) -> list[str]:
    """Before a new run writes into ``workdir``: keep aside every file there that the run writes at the
    top level (:data:`RUN_FILES`, ``confusion_*.png``), so a folder of the user's, or an attempt of another
    config that saved no checkpoint, keeps its summary, plots and metrics (an attempt of the same config
    is this run's: its caches are reused). Returns the names kept aside."""
    if not os.path.isdir(workdir):
        return []
    names = sorted(n for n in os.listdir(workdir) if _run_file(n) and os.path.isfile(os.path.join(workdir, n)))
    moved = [f"{n} -> {os.path.basename(keep_aside(os.path.join(workdir, n)))}" for n in names]
    if moved:
        logging.warning("%s holds no checkpoint of a run; the files this new run writes are kept aside: %s",
                        workdir, ", ".join(moved))
    return names


# ------------------------------------------------------------------------------------- the run

_KINDS: dict[int, type[Exception]] = {1: WorkdirInUse, 2: ConfigChanged, 3: UserError, 4: RuntimeError}
_MESSAGE_BYTES = 4096


def _broadcast(kind: int, message: str) -> tuple[int, str]:
    """Process 0's (kind, message) in every process; a collective, so all call it."""
    from jax.experimental import multihost_utils

    raw = message.encode()[:_MESSAGE_BYTES - 4]
    buf = np.zeros(_MESSAGE_BYTES, np.uint8)
    buf[:4] = np.frombuffer(np.int32(kind).tobytes(), np.uint8)
    buf[4:4 + len(raw)] = np.frombuffer(raw, np.uint8)
    out = np.asarray(multihost_utils.broadcast_one_to_all(buf))
    return int(np.frombuffer(out[:4].tobytes(), np.int32)[0]), out[4:].tobytes().rstrip(b"\0").decode(errors="replace")


@contextlib.contextmanager
def hold(config: mlc.ConfigDict, workdir: str) -> Iterator[Callable[..., None]]:
    """Hold ``workdir`` for one run: lock it and check the config (process 0, for all processes).

    Raises :class:`WorkdirInUse` or :class:`ConfigChanged` in every process alike; the lock is
    released on leaving the block, whether the run ended, was preempted or failed. Yields
    ``save(files=None)``, which the caller calls once its state exists: it writes ``config.json``
    and ``files`` (name -> JSON object, the other files that say what the run is; None for none).
    A new run's config.json is written at once, a resume's only then, so a resume the checkpoint
    refuses (EMA turned off, say) leaves the workdir as it was and the original command still runs.
    """
    import jax

    settings = config.get("workdir") or mlc.ConfigDict()
    lock, failure, kind = None, None, 0
    forget_lock: Callable[[], None] = lambda: None  # noqa: E731
    save: Callable[..., None] = lambda files=None: None  # noqa: E731  (process 0 alone writes)
    if jax.process_index() == 0:
        try:
            inside = inside_dataset(config, workdir)  # first: the write probe below would create the folder
            if inside:
                raise UserError(inside)
            foreign = foreign_steps(workdir)
            if foreign:  # a resume's restore would move them into checkpoints/damaged as unreadable steps
                names = ", ".join(sorted(os.listdir(foreign[0]))[:3])
                raise UserError(f"{foreign[0]} holds another tool's files ({names}), not a jaxrat checkpoint, and "
                                f"jaxrat keeps its checkpoints in that folder; pass another --workdir, or move "
                                f"{os.path.dirname(foreign[0])} out of this one.")
            itself = starts_from_itself(config, workdir)
            if itself:
                raise UserError(itself)
            why = unwritable(workdir)
            if why:
                raise UserError(f"Cannot write to the workdir {workdir} ({why}); train in a folder you can write "
                                "to (--workdir).")
            if field(settings, "workdir.lock"):
                from jaxrat.cluster import preemption, startup_exit

                lock = WorkdirLock(workdir, field(settings, "workdir.lease_seconds"), preemption.signalled)
                forget_lock = startup_exit.on_exit(lock.release)  # a second Ctrl-C during start-up releases it
                lock.acquire()
            save_config = check_config(config, workdir, bool(field(settings, "workdir.allow_config_change")))
            if not has_checkpoint(workdir):
                save_config()
                save_config = lambda: None  # noqa: E731

            def save(files: Mapping[str, Any] | None = None) -> None:
                with exit_guard.whole():  # the run's files are written together or a quick exit waits
                    save_config()
                    write_run_files(workdir, files or {})
        except Exception as e:  # every process must hear of it, or the others wait in the next collective
            failure, kind = e, next((k for k, t in _KINDS.items() if isinstance(e, t)), 4)
    kind, message = _broadcast(kind, str(failure or ""))
    if kind:
        if lock is not None:
            lock.release()
        forget_lock()
        if failure is not None:
            raise failure
        raise _KINDS[kind](message if kind != 4 else f"process 0 could not take the workdir: {message}")
    try:
        yield save
    finally:
        if lock is not None:
            lock.release()
        forget_lock()
