"""Ablation sweeps: named variants of one config, each trained in its own workdir ``ROOT/<name>``.

A config file opts in with ``get_sweep(arg=None)`` next to its ``get_config``, returning either
``{name: overrides}`` or ``[(name, overrides), ...]``, where ``overrides`` is a list of
``"--config.key=value"`` strings (the ``--config.`` prefix may be left out) or a dict
``{"key": value}``. Variants run one after another here (:func:`run_local`) or as the elements
of one job array (``jaxrat.cluster.jobscript``, via ``python -m jaxrat.sweep --slurm``). A variant
whose workdir holds the final checkpoint is finished and skipped; any other resumes from its
checkpoints, because that is what ``jaxrat.main`` does with a workdir.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from jaxrat.cluster.jobscript import ELEMENT_NAME
from jaxrat.config_schema import check_override_args, load_config, load_config_module
from jaxrat.experiments.status import (  # noqa: F401  (sweep's API)
    LEASE_S,
    RunState,
    heartbeat_age,
    holder_stopping,
    live_local_holder,
    run_state,
)
from jaxrat.runtime.errors import ConfigError
from jaxrat.runtime.fileio import write_json

MANIFEST = "sweep.json"  # ROOT/sweep.json: the config, variants and common overrides of the last invocation
_OVERRIDE = re.compile(r"^--config\.[A-Za-z_][\w.]*=")


FOLDS_DIR = "folds"  # ROOT/folds: the cross-validation assignment files (jaxrat.data.folds)


@dataclasses.dataclass(frozen=True)
class Variant:
    """One run of a sweep: its name (also its workdir under the root) and its config overrides;
    a repeat of a variant over folds and seeds also names the variant, its fold and its seed."""

    name: str
    overrides: tuple[str, ...]
    variant: str = ""  # the get_sweep() variant this run repeats ("": the run is the variant)
    fold: int | None = None
    seed: int | None = None

    @property
    def group(self) -> str:
        return self.variant or self.name


def _override(item: Any, where: str) -> str:
    if not isinstance(item, str):
        raise ConfigError(f"{where}: {item!r} is not an override; write '--config.key=value' strings.")
    if item.startswith("--config=") and len(item) > len("--config="):
        return item  # the variant trains another config file (a baseline beside the study's model)
    text = item if item.startswith("--") else f"--config.{item}"
    if not _OVERRIDE.match(text):
        raise ConfigError(f"{where}: {item!r} is not an override; write '--config.key=value', e.g. "
                          "'--config.model.num_blocks=2'.")
    return text


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(_value(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    return str(value)


def parse_sweep(raw: Any, source: str = "get_sweep()") -> list[Variant]:
    """The variants of ``get_sweep()``'s return value, checked for shape and names (not keys)."""
    if isinstance(raw, Mapping):
        pairs = list(raw.items())
    elif isinstance(raw, Sequence) and not isinstance(raw, str) and all(
            isinstance(p, Sequence) and not isinstance(p, str) and len(p) == 2 for p in raw):
        pairs = [tuple(p) for p in raw]
    else:
        raise ConfigError(f"{source} returned {type(raw).__name__}; return {{name: [overrides]}} or a list of "
                          "(name, [overrides]) pairs.")
    if not pairs:
        raise ConfigError(f"{source} returned no variants; name at least one.")
    variants, seen = [], set()
    for name, overrides in pairs:
        if not isinstance(name, str) or not ELEMENT_NAME.match(name):
            raise ConfigError(f"{source}: variant name {name!r} cannot name a workdir; use letters, digits, '.', "
                              "'_' and '-'.")
        if name in seen:
            raise ConfigError(f"{source} names the variant {name!r} twice; give each variant its own name.")
        seen.add(name)
        where = f"{source} variant {name!r}"
        if isinstance(overrides, Mapping):
            items = [f"--config.{k}={_value(v)}" for k, v in overrides.items()]
        elif isinstance(overrides, Sequence) and not isinstance(overrides, str):
            items = list(overrides)
        else:
            raise ConfigError(f"{where}: overrides must be a list of '--config.key=value' strings or a dict.")
        variants.append(Variant(name, tuple(_override(o, where) for o in items)))
    return variants


def load_sweep(config: str, common: Sequence[str] = ()) -> list[Variant]:
    """The variants of ``config`` (``path[:arg]``, calling ``get_sweep(arg)``), every override checked.

    Each variant's overrides, followed by ``common``, must name existing config keys with values of
    the right type (the check ``jaxrat.main`` makes), so a typo fails here and not in job 4 of 5.
    """
    path, _, arg = config.partition(":")
    module = load_config_module(path)
    if not hasattr(module, "get_sweep"):
        raise ConfigError(f"Config file {path} defines no get_sweep(); add one returning {{name: "
                          "['--config.key=value', ...]}} (see configs/ablations.py).")
    try:
        raw = module.get_sweep(arg) if arg else module.get_sweep()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    variants = parse_sweep(raw, f"{path}: get_sweep()")
    common = tuple(_override(o, "--config overrides") for o in common)
    for v in variants:
        check_override_args(["--config", config, *v.overrides, *common])
    return variants


def select(variants: list[Variant], only: Sequence[str]) -> list[Variant]:
    """The variants named in ``only`` (all when empty), in sweep order."""
    names = [v.name for v in variants]
    unknown = [n for n in only if n not in names]
    if unknown:
        raise ConfigError(f"--only {','.join(unknown)}: no such variant; this sweep has {', '.join(names)}.")
    return [v for v in variants if not only or v.name in only]


def base_seed(config: str, common: Sequence[str]) -> int:
    """``seed`` of ``config`` after ``common`` (the last override naming it wins)."""
    for o in reversed(common):
        if o.startswith("--config.seed="):
            return int(o.partition("=")[2])
    return int(load_config(config).seed)


def replicate(variants: list[Variant], root: str, *, folds: int = 0, seeds: int = 1, first_seed: int = 0
              ) -> list[Variant]:
    """Each variant once per fold (``folds`` >= 2) and per seed (``first_seed`` + 0 .. ``seeds`` - 1):
    run ``NAME-f<fold>-s<seed>`` (``-f``/``-s`` only where there are several). The fold and seed
    overrides come after the variant's own and before the common ones."""
    if folds < 0 or folds == 1:
        raise ConfigError(f"--folds {folds}: use 0 (no cross-validation) or K >= 2 folds.")
    if seeds < 1:
        raise ConfigError(f"--seeds {seeds}: use 1 or more seeds.")
    if not folds and seeds == 1:
        return variants
    fold_dir = os.path.join(os.path.abspath(root), FOLDS_DIR)
    out = []
    for v in variants:
        for fold in range(folds) if folds else [None]:
            for i in range(seeds):
                seed = first_seed + i
                name, extra = v.name, [f"--config.seed={seed}"]
                if fold is not None:
                    name += f"-f{fold}"
                    extra += [f"--config.data.folds={folds}", f"--config.data.fold={fold}",
                              f"--config.data.fold_dir={fold_dir}"]
                if seeds > 1:
                    name += f"-s{seed}"
                out.append(Variant(name, (*v.overrides, *extra), v.name, fold, seed))
    return out


def target_steps(config: str, overrides: Sequence[str]) -> int:
    """``num_train_steps`` of ``config`` after ``overrides`` (the last one naming it wins)."""
    config, overrides = own_config(config, overrides)
    for o in reversed(overrides):
        if o.startswith("--config.num_train_steps="):
            return int(o.partition("=")[2])
    return int(load_config(config).num_train_steps)


# ------------------------------------------------------------------------------------ running

def own_config(config: str, overrides: Sequence[str]) -> tuple[str, list[str]]:
    """(the config file a variant trains, its ``--config.key=value`` overrides): a variant whose
    overrides hold ``--config=FILE[:ARG]`` (e.g. a baseline model of the study) trains that file
    (the last such item), every other variant ``config``."""
    rest = [o for o in overrides if not o.startswith("--config=")]
    chosen = [o.partition("=")[2] for o in overrides if o.startswith("--config=")]
    return (chosen[-1] if chosen else config), rest


def train_command(config: str, workdir: str, overrides: Sequence[str], python: str = sys.executable) -> list[str]:
    """The ``python -m jaxrat.main`` command line of one variant (see :func:`own_config`)."""
    config, overrides = own_config(config, overrides)
    return [python, "-m", "jaxrat.main", f"--config={config}", f"--workdir={workdir}", *overrides]


def write_manifest(root: str, config: str, variants: list[Variant], common: Sequence[str]) -> None:
    """``ROOT/sweep.json``: what was swept, for the summary's order and its overrides column."""
    os.makedirs(root, exist_ok=True)
    data = {"config": config, "common": list(common),
            "variants": [{"name": v.name, "overrides": list(v.overrides), "variant": v.group, "fold": v.fold,
                          "seed": v.seed} for v in variants]}
    write_json(os.path.join(root, MANIFEST), data, indent=2)


def die_with_parent() -> None:
    """In a child: SIGTERM when its parent dies, even by kill -9 (Linux), so no orphan trains on
    (it checkpoints and exits 42, as when preempted)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


MARK_GRACE_S = 5.0  # how long a holder told to stop may take to say so (its heartbeat notices in 0.5 s)


def wait_for_stopping_run(workdir: str, what: str, wait_s: float | None = None) -> int | None:
    """Wait while a run on this host that was told to stop still holds ``workdir``; return the
    process id of a live holder that is training instead (the caller must not start beside it), or
    None once the workdir is free.

    A sweep or tuner killed with -9 leaves its training to stop on the parent-death SIGTERM: it
    saves and releases the workdir, and a rerun started meanwhile found it locked and counted the
    variant as failed. A stopping run says so beside its lock (``run.lock.stopping``) and is waited
    for as long as its heartbeat goes on, however long its save takes; a run that is training says
    nothing and is reported at once (after :data:`MARK_GRACE_S`, the time a just-signalled run needs
    to say it is stopping). A lock whose holder is dead, or whose heartbeat stopped, is left to the
    run's own lock, which takes it over or names it. ``wait_s``: an upper bound, for tests.
    """
    start, said = time.monotonic(), False
    while (pid := live_local_holder(workdir)) is not None:
        waited = time.monotonic() - start
        if wait_s is not None and waited > wait_s:
            return None
        if holder_stopping(workdir):
            age = heartbeat_age(workdir)
            if age is not None and age > LEASE_S:
                return None
            if not said:
                print(f"{what}: {workdir} is held by process {pid}, a run still stopping; waiting for it while its "
                      f"heartbeat goes on", flush=True)
                said = True
        elif waited > MARK_GRACE_S:
            return pid
        time.sleep(0.5)
    return None


def _train(cmd: list[str]) -> int:
    """Run one training to its end. A SIGTERM to the sweep is passed on (the run checkpoints and
    exits 42, as when preempted); on Ctrl-C, which the run receives too, give it time to stop."""
    proc = subprocess.Popen(cmd, preexec_fn=die_with_parent)
    on_main = threading.current_thread() is threading.main_thread()  # only there may handlers change
    previous = signal.signal(signal.SIGTERM, lambda *_: proc.send_signal(signal.SIGTERM)) if on_main else None
    try:
        return proc.wait()
    except KeyboardInterrupt:
        try:
            proc.wait(timeout=60)
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            proc.kill()
            proc.wait()
        raise
    finally:
        if on_main:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def run_local(config: str, root: str, variants: list[Variant], common: Sequence[str] = (), *,
              dry_run: bool = False, python: str = sys.executable) -> int:
    """Train the unfinished ``variants`` one after another; the exit status of the sweep.

    A failed variant (a crash, a config error) does not stop the others; a preempted one (status
    42) or an interrupt does, since whoever asked this process to stop meant the whole sweep.
    """
    failed: list[str] = []
    busy: list[str] = []
    for i, v in enumerate(variants, 1):
        workdir = os.path.join(root, v.name)
        args = [*v.overrides, *common]
        state = run_state(workdir, target_steps(config, args))
        head = f"sweep [{i}/{len(variants)}] {v.name}"
        if state.finished:
            print(f"{head}: {state.describe()} (step {state.step}), skipped", flush=True)
            continue
        cmd = train_command(config, workdir, args, python)
        verb = "would resume" if dry_run else "resuming"
        what = f"{verb} {state.describe()}" if state.step is not None else ("would train" if dry_run else "training")
        print(f"{head}: {what}: {shlex.join(cmd)}", flush=True)
        if dry_run:
            continue
        training = wait_for_stopping_run(workdir, head)
        if training is not None:
            print(f"{head}: {workdir} is being trained by process {training} on this host; skipped (not counted "
                  f"as failed): rerun the sweep once it ends", flush=True)
            busy.append(v.name)
            continue
        try:
            status = _train(cmd)
        except KeyboardInterrupt:
            print(f"{head}: interrupted; rerun the sweep to resume it", flush=True)
            return 130
        if status == 0:
            continue
        failed.append(v.name)
        print(f"{head}: ended with status {status}", flush=True)
        if status in (42, -signal.SIGINT, -signal.SIGTERM, 130, 143):
            print("sweep: stopped (the run was preempted or interrupted); rerun the sweep to resume", flush=True)
            return status if status > 0 else 128 - status
    if failed:
        print(f"sweep: {len(failed)} of {len(variants)} variants failed ({', '.join(failed)}); their logs are "
              "above, and a rerun resumes them", flush=True)
    if busy:
        print(f"sweep: {len(busy)} of {len(variants)} variants are being trained by another process "
              f"({', '.join(busy)}); rerun the sweep once they end", flush=True)
    return 1 if failed or busy else 0
