"""Hyperparameter search with Optuna: each trial one ``jaxrat.main`` run, pruned on its eval metrics.

A config file opts in with ``get_search_space(arg=None)`` next to ``get_config``, returning
``{"optimizer.learning_rate": {"type": "float", "low": 1e-4, "high": 1e-2, "log": True},
"model.rat.num_blocks": {"type": "int", "low": 1, "high": 4}, "optimizer.b1": {"type": "categorical",
"choices": [0.9, 0.95]}}``. The study lives in ``ROOT/optuna_journal.log`` (Optuna's
JournalStorage on a file: appends under a file lock, so workers on several nodes, e.g. the
elements of a SLURM job array, share it), with a TPE sampler and a median pruner.

A worker (:func:`run_worker`) asks for a trial, trains it in ``ROOT/trials/trial_<n>`` as a
subprocess, and follows its ``metrics.jsonl`` (:mod:`jaxrat.experiments.tune_trial`): every
evaluation of the objective metric is reported to the trial, and when the pruner says so the run
gets SIGTERM (it checkpoints and stops, as when preempted) and the trial is PRUNED. Workers stop
when the study holds ``trials`` trials and none of them is still queued.

A trial whose worker died (kill -9, a lost node) stays RUNNING in the journal; a worker that
finds one (its worker's process gone from this host, or its heartbeat file older than
:data:`STALE_S`) marks it FAIL and queues its parameters again with its workdir, so the retry
resumes the run from its checkpoint. Such a replaced trial does not count towards ``trials``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Any, Iterator, Sequence

from jaxrat.config_schema import check_override_args, load_config, load_config_module
from jaxrat.experiments.sweep import _value, train_command
from jaxrat.experiments.tune_trial import Interrupted, run_trial
from jaxrat.runtime.errors import ConfigError, UserError

JOURNAL = "optuna_journal.log"
STUDY = "jaxrat"
TRIALS_DIR = "trials"
WORKERS_DIR = "workers"
STALE_S = 120.0  # a worker's heartbeat this old means the worker is gone
HEARTBEAT_S = 10.0
REPLACED = "replaced"  # user attr of a FAIL trial whose parameters were queued again
TYPES = ("float", "int", "categorical")


# ------------------------------------------------------------------------------ the search space

def load_search_space(config: str, common: Sequence[str] = ()) -> dict[str, dict[str, Any]]:
    """``get_search_space(arg)`` of ``config`` (``path[:arg]``), checked: known keys, values that
    the config accepts, well-formed ranges."""
    path, _, arg = config.partition(":")
    module = load_config_module(path)
    if not hasattr(module, "get_search_space"):
        raise ConfigError(f"Config file {path} defines no get_search_space(); add one returning "
                          "{'optimizer.learning_rate': {'type': 'float', 'low': 1e-4, 'high': 1e-2, 'log': True}} "
                          "(see configs/ablations.py).")
    try:
        raw = module.get_search_space(arg) if arg else module.get_search_space()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(f"{path}: get_search_space() must return a non-empty dict {{config key: range}}.")
    space = {}
    for key, spec in raw.items():
        where = f"{path}: get_search_space()[{key!r}]"
        if not isinstance(spec, dict) or spec.get("type") not in TYPES:
            raise ConfigError(f"{where} must be a dict with 'type' one of {list(TYPES)}.")
        if spec["type"] == "categorical":
            if not spec.get("choices"):
                raise ConfigError(f"{where}: a categorical range needs a non-empty 'choices' list.")
            # Optuna stores scalars only: a tuple choice (a U-Net's widths) travels as its override text.
            spec = {**spec, "choices": [c if c is None or isinstance(c, (bool, int, float, str)) else _value(c)
                                        for c in spec["choices"]]}
            samples = list(spec["choices"])
        else:
            if "low" not in spec or "high" not in spec or not spec["low"] <= spec["high"]:
                raise ConfigError(f"{where}: give 'low' <= 'high'.")
            samples = [spec["low"], spec["high"]]
        for v in samples:  # a typo'd key or a value the field refuses fails before any trial
            check_override_args(["--config", config, f"--config.{key.removeprefix('--config.')}={_value(v)}",
                                 *common])
        space[key.removeprefix("--config.")] = dict(spec)
    return space


def suggest(trial: Any, space: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The trial's value for every key of the space."""
    out = {}
    for key, s in space.items():
        if s["type"] == "float":
            out[key] = trial.suggest_float(key, s["low"], s["high"], log=bool(s.get("log")), step=s.get("step"))
        elif s["type"] == "int":
            out[key] = trial.suggest_int(key, s["low"], s["high"], log=bool(s.get("log")), step=s.get("step", 1))
        else:
            out[key] = trial.suggest_categorical(key, list(s["choices"]))
    return out


def to_overrides(params: dict[str, Any]) -> list[str]:
    return [f"--config.{k}={_value(v)}" for k, v in params.items()]


def objective(config: str, common: Sequence[str], metric: str = "", mode: str = "") -> tuple[str, str]:
    """(metric, "maximize" | "minimize"): ``metric``/``mode``, else the config's
    ``checkpoint.best_metric``/``best_mode`` after ``common``."""
    c = load_config(config)
    found = {"checkpoint.best_metric": c.checkpoint.best_metric, "checkpoint.best_mode": c.checkpoint.best_mode}
    for o in common:
        key, _, value = o.removeprefix("--config.").partition("=")
        if key in found:
            found[key] = value
    metric, mode = metric or found["checkpoint.best_metric"], mode or found["checkpoint.best_mode"]
    if not metric:
        raise ConfigError("No metric to optimise: pass --metric eval/NAME or set --config.checkpoint.best_metric.")
    if mode not in ("max", "min"):
        raise ConfigError(f"--mode {mode!r}; use 'max' or 'min'.")
    return metric, "maximize" if mode == "max" else "minimize"


# ------------------------------------------------------------------------------------ the study

def open_study(root: str, direction: str, seed: int = 0) -> Any:
    """The study of ``root`` (created on first use): journal file storage, TPE, median pruning."""
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    os.makedirs(root, exist_ok=True)
    storage = JournalStorage(JournalFileBackend(os.path.join(root, JOURNAL)))
    sampler = sampler_for(seed)
    # Pruning starts once two trials have reported; a trial is pruned at an evaluation where it is
    # worse than the median of the earlier trials at the same step.
    pruner = optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=0)
    return optuna.create_study(study_name=STUDY, storage=storage, sampler=sampler, pruner=pruner,
                               direction=direction, load_if_exists=True)


def sampler_for(seed: int, worker_index: int = 0, trials_before: int = 0) -> Any:
    """TPE seeded from the search's ``seed``, the worker's index and the trial's place in the study
    (the counted trials older than it): the same for the same trial of a rerun, different between
    workers and between trials."""
    import numpy as np
    import optuna

    mixed = int(np.random.SeedSequence([seed, worker_index, trials_before]).generate_state(1)[0])
    return optuna.samplers.TPESampler(seed=mixed, n_startup_trials=3)


def counted(study: Any) -> list[Any]:
    """The trials that count towards ``--trials``: all but the replaced ones, except a replaced
    trial whose retry is not queued yet. Marking a trial replaced and queueing its retry are two
    writes to the journal; between them, another worker counted one trial too few and started a
    fresh one (three workers ended with four trials of three). A replaced trial without parameters
    (one that yielded the last place, see :func:`budget_left`) never gets a retry."""
    trials = study.get_trials(deepcopy=False)
    retried = {t.user_attrs.get("retry_of") for t in trials}
    return [t for t in trials if not t.user_attrs.get(REPLACED) or (t.params and t.number not in retried)]


def queued(study: Any) -> list[Any]:
    """The WAITING trials: retries of replaced trials (and any a user enqueued). They count towards
    ``--trials`` but have not run, so a worker runs them before it may stop."""
    import optuna

    return study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,))


def budget_left(study: Any, trial: Any, trials: int) -> bool:
    """Whether the just-asked ``trial`` is within ``trials``: a queued one always is (it replaces a
    counted trial); a fresh one only if fewer than ``trials`` counted trials are older than it,
    so of two workers that asked at once for the last place, the later one yields."""
    if trial.user_attrs.get("retry_of") is not None:
        return True
    return len([t for t in counted(study) if t.number < trial.number]) < trials


def _worker_alive(worker: str, root: str) -> bool:
    host, _, pid = worker.rpartition("-")
    beat = os.path.join(root, WORKERS_DIR, worker)
    if host == socket.gethostname() and pid.isdigit():
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
    try:
        return time.time() - os.path.getmtime(beat) < STALE_S
    except OSError:
        return False


_asking = [0]  # threads of this process between ask() and naming themselves on the trial
_asking_lock = threading.Lock()


def _someone_may_be_naming(root: str, me: str) -> bool:
    """Whether a live worker other than ``me`` (or another thread of this process) may have asked
    for a trial and not yet named itself on it."""
    with _asking_lock:
        if _asking[0]:
            return True
    try:
        names = os.listdir(os.path.join(root, WORKERS_DIR))
    except OSError:
        return False
    return any(name != me and _worker_alive(name, root) for name in names)


def recover_stale(study: Any, root: str, me: str = "") -> list[int]:
    """Mark RUNNING trials whose worker is gone FAIL (replaced) and queue their parameters again
    with their workdir; returns their numbers. ``me``: the calling worker's name."""
    import optuna

    out = []
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        worker = t.user_attrs.get("worker")
        if worker and _worker_alive(worker, root):
            continue
        # A worker killed between asking and naming itself leaves a trial without one: stale at once
        # when no live worker could be naming itself on it, else once old. (Waiting for the age
        # alone, a rerun counted the orphan, ran one trial too few and left it RUNNING.)
        young = t.datetime_start is None or time.time() - t.datetime_start.timestamp() < STALE_S
        if not worker and young and _someone_may_be_naming(root, me):
            continue
        try:
            study._storage.set_trial_user_attr(t._trial_id, REPLACED, True)
            study._storage.set_trial_state_values(t._trial_id, optuna.trial.TrialState.FAIL)
        except Exception:  # another worker got there first
            continue
        study.enqueue_trial(t.params, user_attrs={"workdir": t.user_attrs.get("workdir", ""), "retry_of": t.number})
        logging.warning("tune: trial %d was left running by worker %s, which is gone; it is queued again and "
                        "resumes from its checkpoint", t.number, worker)
        out.append(t.number)
    return out


# ------------------------------------------------------------------------------------- a worker

def run_worker(config: str, root: str, trials: int, common: Sequence[str] = (), *, metric: str = "",
               mode: str = "", seed: int = 0, python: str = sys.executable, worker_index: int = 0) -> int:
    """Run trials until the study of ``root`` holds ``trials`` (replaced ones aside); exit status.

    ``worker_index`` (a job-array element's) and each trial's place in the study go into the
    sampler's seed (:func:`sampler_for`): workers started together with one ``--seed`` drew the
    same parameters (two elements of a SLURM array ran trials 0 and 1, and 2 and 3, with identical
    overrides), and so did a resubmitted worker during the random start-up trials."""
    if trials < 1:
        raise UserError(f"--trials {trials}: run at least one trial.")
    root = os.path.abspath(root)
    space = load_search_space(config, common)
    metric, direction = objective(config, common, metric, mode)
    study = open_study(root, direction, seed)
    worker = f"{socket.gethostname()}-{os.getpid()}"
    stop = threading.Event()
    with _heartbeat(os.path.join(root, WORKERS_DIR, worker)), _stopping_on_signals(stop):
        while not stop.is_set():
            recover_stale(study, root, worker)
            # A retry queued by recover_stale counts already (it replaces its trial) but has not
            # run: stopping on the count alone stranded it and reported the wrong best trial.
            if not queued(study) and len(counted(study)) >= trials:
                break
            trial = _ask(study, worker)
            if not budget_left(study, trial, trials):  # another worker asked at the same moment and took the last one
                _fail_replaced(study, trial)
                break
            params, workdir = _draw(study, trial, space, root, seed, worker_index)
            cmd = train_command(config, workdir, [*to_overrides(params), *common], python)
            logging.info("tune: trial %d: %s", trial.number, " ".join(to_overrides(params)))
            try:
                state, value = run_trial(trial, cmd, workdir, metric, stop=stop)
            except Interrupted:
                # Queued again with its workdir: the next worker resumes it from its checkpoint.
                _fail_replaced(study, trial)
                study.enqueue_trial(params, user_attrs={"workdir": workdir, "retry_of": trial.number})
                break
            _tell(study, trial, state, value, metric)
    return 42 if stop.is_set() else 0


@contextlib.contextmanager
def _heartbeat(beat: str) -> Iterator[None]:
    """The file ``beat`` exists while the block runs, touched every :data:`HEARTBEAT_S`: other workers
    take a trial whose worker's file is older than :data:`STALE_S` for abandoned."""
    os.makedirs(os.path.dirname(beat), exist_ok=True)
    alive = threading.Event()

    def touch() -> None:
        while not alive.wait(HEARTBEAT_S):
            with open(beat, "a"):
                os.utime(beat)

    with open(beat, "a"):
        pass
    threading.Thread(target=touch, daemon=True).start()
    try:
        yield
    finally:
        alive.set()
        with contextlib.suppress(OSError):
            os.remove(beat)


@contextlib.contextmanager
def _stopping_on_signals(stop: threading.Event) -> Iterator[None]:
    """SIGTERM and SIGINT set ``stop`` while the block runs (Python lets only the main thread handle them)."""
    on_main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGTERM, signal.SIGINT)} if on_main else {}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _ask(study: Any, worker: str) -> Any:
    """A new trial, named for ``worker``; until it is, other workers' :func:`recover_stale` waits."""
    with _asking_lock:
        _asking[0] += 1
    try:
        trial = study.ask()
        trial.set_user_attr("worker", worker)
        return trial
    finally:
        with _asking_lock:
            _asking[0] -= 1


def _draw(study: Any, trial: Any, space: dict[str, dict[str, Any]], root: str, seed: int,
          worker_index: int) -> tuple[dict[str, Any], str]:
    """The trial's parameters and workdir (a retry's are those of the trial it replaces), recorded on it."""
    # Seeded per trial, not per worker start: a worker started after a kill drew other
    # parameters than the undisturbed search for the trials after the retry, and so reported
    # another best trial. (The sampler is only asked in suggest(); a retry's parameters are
    # fixed, unless its trial was lost before it had any.)
    place = len([t for t in counted(study) if t.number < trial.number])
    study.sampler = sampler_for(seed, worker_index, place)
    params = suggest(trial, space)
    workdir = trial.user_attrs.get("workdir") or os.path.join(root, TRIALS_DIR, f"trial_{trial.number}")
    trial.set_user_attr("workdir", workdir)
    trial.set_user_attr("overrides", to_overrides(params))
    return params, workdir


def _fail_replaced(study: Any, trial: Any) -> None:
    """End the worker's own ``trial`` as FAIL and replaced: it no longer counts towards ``--trials``."""
    import optuna

    study._storage.set_trial_user_attr(trial._trial_id, REPLACED, True)
    study.tell(trial, state=optuna.trial.TrialState.FAIL)


def _tell(study: Any, trial: Any, state: str, value: float | None, metric: str) -> None:
    """Record how :func:`run_trial` ended ``trial``."""
    import optuna

    if state == "complete":
        study.tell(trial, value)
    elif state == "pruned":
        study.tell(trial, state=optuna.trial.TrialState.PRUNED)
    else:
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
    logging.info("tune: trial %d %s%s", trial.number, state, f" ({metric} {value:.4g})" if value is not None
                 else "")
