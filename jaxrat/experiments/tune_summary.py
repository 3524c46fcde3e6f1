"""What a search found: ``ROOT/tune_summary.{md,json}`` and the best trial as a sweep variant file.

The summary lists every trial (state, objective value, the step it reached, its overrides), the
pruned ones among them, and the parameters' importances (Optuna's fANOVA over the complete
trials, when there are at least two). ``ROOT/best_sweep.py`` is a config file whose
``get_sweep()`` has one variant, ``best``: the searched config with the best trial's overrides
(and the search's common ones), so ``python -m jaxrat.sweep --config ROOT/best_sweep.py --seeds 3``
retrains it over seeds (or folds).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from jaxrat.experiments.status import run_status
from jaxrat.experiments.tune import JOURNAL, REPLACED, STUDY
from jaxrat.runtime.errors import UserError
from jaxrat.runtime.fileio import write_text

SUMMARY = "tune_summary"
BEST_SWEEP = "best_sweep.py"
SETTINGS = "tune.json"  # the config, objective and common overrides of the search (written by jaxrat.tune)


def load_study(root: str) -> Any:
    """The study of ``root``, read-only use (no sampler or pruner needed); a root that holds no
    search is a :class:`UserError` (Optuna's backend would create an empty journal there)."""
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    journal = os.path.join(root, JOURNAL)
    fix = "pass the --root of a python -m jaxrat.tune search"
    if not os.path.isdir(root):
        raise UserError(f"{root} does not exist; {fix}.")
    if not os.path.isfile(journal):
        raise UserError(f"{root} holds no search (no {JOURNAL}); {fix}.")
    try:
        return optuna.load_study(study_name=STUDY, storage=JournalStorage(JournalFileBackend(journal)))
    except KeyError:
        raise UserError(f"{journal} holds no study {STUDY!r}; {fix}.") from None


def collect(root: str) -> dict[str, Any]:
    """The summary's content."""
    import optuna

    study = load_study(root)
    settings: dict[str, Any] = {}
    try:
        with open(os.path.join(root, SETTINGS)) as f:
            settings = json.load(f)
    except (OSError, ValueError):
        pass
    rows = []
    for t in study.get_trials(deepcopy=False):
        steps = sorted(t.intermediate_values)
        rows.append({"number": t.number, "state": t.state.name.lower(), "value": t.value,
                     "last_step": steps[-1] if steps else None,
                     "last_reported": t.intermediate_values[steps[-1]] if steps else None,
                     "params": t.params, "overrides": t.user_attrs.get("overrides", []),
                     "workdir": t.user_attrs.get("workdir"), "replaced": bool(t.user_attrs.get(REPLACED)),
                     "run": _run_status(t.user_attrs.get("workdir")),
                     "retry_of": t.user_attrs.get("retry_of")})
    complete = [t for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))]
    best = None
    if complete:
        b = study.best_trial
        best = {"number": b.number, "value": b.value, "params": b.params,
                "overrides": b.user_attrs.get("overrides", [])}
    importances: dict[str, float] = {}
    if len(complete) >= 2 and len(complete[0].params) >= 1:
        try:
            importances = {k: float(v) for k, v in optuna.importance.get_param_importances(study).items()}
        except Exception as e:  # e.g. every complete trial with the same value
            logging.warning("tune: no parameter importances (%s: %s)", type(e).__name__, e)
    counts: dict[str, int] = {}
    for r in rows:
        if not r["replaced"]:
            counts[r["state"]] = counts.get(r["state"], 0) + 1
    return {"root": os.path.abspath(root), "direction": study.direction.name.lower(), **settings,
            "counts": counts, "pruned": [r["number"] for r in rows if r["state"] == "pruned"],
            "best": best, "importances": importances, "trials": rows}


def _run_status(workdir: str | None) -> str:
    """The trial's training in the words every table uses (:func:`jaxrat.experiments.status.run_status`)."""
    if not workdir:
        return "not started"
    config: dict[str, Any] = {}
    try:
        with open(os.path.join(workdir, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        pass
    total = config.get("num_train_steps") if isinstance(config, dict) else None
    return run_status(workdir, total if isinstance(total, int) else None)


def _fmt(v: Any) -> str:
    if v is None:
        return ""
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def markdown(s: dict[str, Any]) -> str:
    lines = [f"# Hyperparameter search: {s['root']}", "",
             f"Objective: {s.get('metric', '?')} ({s['direction']}); config {s.get('config', '?')}.", "",
             "Trials: " + ", ".join(f"{n} {k}" for k, n in sorted(s["counts"].items())) +
             (f"; pruned: {', '.join(map(str, s['pruned']))}" if s["pruned"] else "; none pruned"), ""]
    if s["best"]:
        lines += [f"Best: trial {s['best']['number']}, {s.get('metric', 'value')} {_fmt(s['best']['value'])}: "
                  f"`{' '.join(s['best']['overrides'])}`", ""]
    if s["importances"]:
        lines += ["## Parameter importances", "", "| parameter | importance |", "|---|---|"]
        lines += [f"| {k} | {v:.3f} |" for k, v in s["importances"].items()] + [""]
    lines += ["## Trials", "", "| trial | state | value | last step | last reported | run | overrides |",
              "|---|---|---|---|---|---|---|"]
    for r in s["trials"]:
        state = r["state"] + (" (queued again as a retry)" if r["replaced"] else "")
        state += f" (retry of {r['retry_of']})" if r["retry_of"] is not None else ""
        overrides = " ".join(o.removeprefix("--config.") for o in r["overrides"])
        lines.append(f"| {r['number']} | {state} | {_fmt(r['value'])} | {_fmt(r['last_step'])} | "
                     f"{_fmt(r['last_reported'])} | {r.get('run', '')} | {overrides} |")
    return "\n".join(lines) + "\n"


def best_sweep_file(s: dict[str, Any]) -> str | None:
    """A config file with ``get_sweep() -> {"best": overrides}`` over the searched config."""
    if not s["best"] or not s.get("config"):
        return None
    overrides = [*s["best"]["overrides"], *s.get("common", [])]
    # Every embedded string goes in as a Python literal (repr), the docstring too: a root named with
    # quotes or newlines must not become code in a file the user will run.
    doc = f'Written by python -m jaxrat.tune: trial {s["best"]["number"]} of {s["root"]}, ' \
          f'{s.get("metric")} {s["best"]["value"]!r}.'
    return (f"{doc!r}\n\n"
            "from jaxrat.config_schema import load_config\n\n"
            f"CONFIG = {s['config']!r}\n"
            f"BEST = {overrides!r}\n\n\n"
            "def get_config(arg=None):\n    return load_config(CONFIG)\n\n\n"
            "def get_sweep(arg=None):\n    return {\"best\": BEST}\n")


def write(root: str) -> dict[str, Any]:
    """Write the summary files (and the best variant's file) under ``root``; return the content."""
    s = collect(root)
    files = {f"{SUMMARY}.json": json.dumps(s, indent=2, default=str) + "\n", f"{SUMMARY}.md": markdown(s)}
    best = best_sweep_file(s)
    if best:
        files[BEST_SWEEP] = best
    for name, text in files.items():
        write_text(os.path.join(root, name), text)
    return s
