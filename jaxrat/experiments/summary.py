"""One comparison table of a sweep's runs: ``ROOT/summary.md``, ``summary.csv`` and ``summary.png``.

Each subfolder of the root with a ``metrics.jsonl`` is a run. Per run the table holds its state
(finished, or the step its newest checkpoint reached), its last evaluation's metrics, the best
value of ``config.checkpoint.best_metric`` over its evaluations (with the step), and its last
training loss; the markdown table shows at most :data:`MAX_COLUMNS` of them (:func:`narrow`), the
CSV all. The plot draws every evaluation metric against the step, one line per run.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import logging
import os
from typing import Any

from jaxrat.checkpointing.store import rank
from jaxrat.experiments import stats as repeat_stats
from jaxrat.experiments.status import run_status
from jaxrat.experiments.sweep import MANIFEST
from jaxrat.runtime.errors import UserError
from jaxrat.runtime.fileio import save_figure, write_text

EVAL_PREFIX = "eval/"


@dataclasses.dataclass
class RunSummary:
    """What the table says about one run."""

    name: str
    state: str
    last_step: int | None  # the newest step logged
    eval_step: int | None  # the step of the last evaluation
    last_eval: dict[str, float]
    history: dict[str, list[tuple[int, float]]]  # eval metric -> [(step, value)], newest value per step
    best_metric: str = ""
    best_mode: str = "max"
    best: tuple[int, float] | None = None
    train_loss: float | None = None
    overrides: tuple[str, ...] = ()


def read_metrics(path: str) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl``; a line cut short (a run killed mid-write) is skipped."""
    rows = []
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int):
                rows.append(row)
    return rows


def summarize_run(workdir: str, name: str, overrides: tuple[str, ...] = ()) -> RunSummary:
    """The :class:`RunSummary` of one workdir (a resumed run re-logs steps: the newest line wins)."""
    rows = read_metrics(os.path.join(workdir, "metrics.jsonl"))
    config: dict[str, Any] = {}
    try:
        with open(os.path.join(workdir, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        pass
    history: dict[str, dict[int, float]] = {}
    last_eval: dict[str, float] = {}
    eval_step = last_step = None
    train_loss = None
    for row in rows:
        evals = {k: float(v) for k, v in row.items() if k.startswith(EVAL_PREFIX) and isinstance(v, (int, float))}
        last_step = row["step"] if last_step is None else max(last_step, row["step"])
        if evals:
            for k, v in evals.items():
                history.setdefault(k, {})[row["step"]] = v
            if eval_step is None or row["step"] >= eval_step:
                last_eval = {**last_eval, **evals} if row["step"] == eval_step else evals
                eval_step = row["step"]
        if "train/loss" in row:
            train_loss = float(row["train/loss"])
    checkpoint = config.get("checkpoint") or {}
    best_metric, best_mode = checkpoint.get("best_metric") or "", checkpoint.get("best_mode") or "max"
    best = None
    if best_metric in history:
        best = max(history[best_metric].items(), key=lambda p: rank(p[1], p[0], best_mode))
    total = config.get("num_train_steps")
    state = run_status(workdir, total if isinstance(total, int) else None)
    return RunSummary(name, state, last_step, eval_step, last_eval,
                      {k: sorted(v.items()) for k, v in history.items()}, best_metric, best_mode, best,
                      train_loss, overrides)


def collect(root: str) -> list[RunSummary]:
    """Every run under ``root``, in the sweep's order (``sweep.json``), then by name."""
    order: dict[str, tuple[str, ...]] = {}
    try:
        with open(os.path.join(root, MANIFEST)) as f:
            order = {v["name"]: tuple(v["overrides"]) for v in json.load(f)["variants"]}
    except (OSError, ValueError, KeyError, TypeError):
        pass
    names = sorted(n for n in os.listdir(root) if os.path.isfile(os.path.join(root, n, "metrics.jsonl")))
    names.sort(key=lambda n: list(order).index(n) if n in order else len(order))
    return [summarize_run(os.path.join(root, n), n, order.get(n, ())) for n in names]


def _metric_names(runs: list[RunSummary]) -> list[str]:
    names: list[str] = []
    for r in runs:
        names += [k for k in r.last_eval if k not in names]
    return names


def table(runs: list[RunSummary]) -> tuple[list[str], list[list[Any]]]:
    """(header, rows) of the comparison; a missing value is None."""
    metrics = _metric_names(runs)
    best = sorted({r.best_metric for r in runs if r.best_metric})
    header = ["run", "state", "step", "eval step", *metrics]
    modes = {r.best_metric: r.best_mode for r in runs if r.best_metric}
    header += [f"best {m} ({modes[m]})" for m in best]
    header += [f"best {m} step" for m in best] + ["train/loss", "overrides"]
    rows = []
    for r in runs:
        row: list[Any] = [r.name, r.state, r.last_step, r.eval_step, *[r.last_eval.get(m) for m in metrics]]
        row += [r.best[1] if r.best and r.best_metric == m else None for m in best]
        row += [r.best[0] if r.best and r.best_metric == m else None for m in best]
        row += [r.train_loss, " ".join(o.removeprefix("--config.") for o in r.overrides)]
        rows.append(row)
    return header, rows


# Columns of the markdown table (a terminal's width); summary.csv keeps every column.
MAX_COLUMNS = 10
# Eval metrics shown first when the table must choose (after each run's ranked metric).
_PREFERRED = ("eval/dice", "eval/iou", "eval/top1", "eval/AP", "eval/AP50", "eval/accuracy", "eval/loss")


def narrow(header: list[str], rows: list[list[Any]], limit: int = MAX_COLUMNS
           ) -> tuple[list[str], list[list[Any]], list[str]]:
    """(header, rows, hidden columns) of the table cut to ``limit`` columns: the run, its state and
    steps, the best value and train loss and overrides always; of the last eval's metrics the ranked
    one first, then the usual ones (:data:`_PREFERRED`), then the rest, as many as fit."""
    metrics = [h for h in header if h.startswith(EVAL_PREFIX)]
    fixed = [h for h in header if h not in metrics]
    ranked = [h[len("best "):].rsplit(" (", 1)[0] for h in header if h.startswith("best ") and h.endswith(")")]
    order = [m for m in ranked if m in metrics] + [m for m in _PREFERRED if m in metrics]
    order = list(dict.fromkeys(order + metrics))
    keep = set(fixed) | set(order[:max(2, limit - len(fixed))])
    cols = [i for i, h in enumerate(header) if h in keep]
    return ([header[i] for i in cols], [[row[i] for i in cols] for row in rows],
            [h for h in header if h not in keep])


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4f}"
    return str(value).replace("|", "\\|")


def to_markdown(header: list[str], rows: list[list[Any]]) -> str:
    """A GitHub-flavoured markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def to_csv(header: list[str], rows: list[list[Any]]) -> str:
    """The same table as CSV, numbers at full precision."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(["" if v is None else v for v in row] for row in rows)
    return out.getvalue()


def plot(runs: list[RunSummary], path: str) -> bool:
    """Every eval metric against the step, one line per run, into ``path``; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only; no display on a login node
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        logging.warning("matplotlib is not installed, so %s is not drawn; pip install matplotlib (a jaxrat dependency)",
                        path)
        return False
    # A metric with one value everywhere (e.g. eval/num_images) has nothing to compare.
    metrics = [m for m in _metric_names(runs) if len({v for r in runs for _, v in r.history.get(m, ())}) > 1]
    first = sorted({r.best_metric for r in runs if r.best_metric in metrics})
    metrics = first + [m for m in metrics if m not in first]
    cols = min(3, max(1, len(metrics)))
    rows = max(1, -(-len(metrics) // cols))
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.2 * rows), squeeze=False)
    for ax, metric in zip(axes.flat, metrics):
        for r in runs:
            points = r.history.get(metric)
            if points:
                ax.plot([s for s, _ in points], [v for _, v in points], marker="o", markersize=3, label=r.name)
        ax.set_title(metric)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in list(axes.flat)[len(metrics):]:
        ax.axis("off")
    if metrics:
        axes.flat[0].legend(fontsize="small")
    fig.tight_layout()
    save_figure(path, fig, dpi=100)
    plt.close(fig)
    return True


def study_markdown(root: str, runs: list[RunSummary]) -> tuple[str, dict[str, Any] | None]:
    """The per-run table, then (for a sweep over folds/seeds) the variants' mean ± sd and paired
    differences (:mod:`jaxrat.experiments.stats`); and those numbers."""
    header, rows, hidden = narrow(*table(runs))
    text = to_markdown(header, rows)
    if hidden:
        text += f"\n{len(hidden)} more columns in summary.csv: {', '.join(hidden)}.\n"
    numbers = repeat_stats.compute(root, runs)
    if numbers is not None:
        primary = sorted({r.best_metric for r in runs if r.best_metric})
        text += "\n" + repeat_stats.markdown(numbers, primary)
    return text, numbers


def write_summary(root: str, runs: list[RunSummary] | None = None) -> list[RunSummary]:
    """Write ``summary.md``, ``summary.csv`` and ``summary.png`` (and ``summary_stats.json`` for a
    sweep over folds/seeds) under ``root``; return the runs (``runs`` when given, else :func:`collect`'s)."""
    runs = collect(root) if runs is None else runs
    text, numbers = study_markdown(root, runs)
    write_text(os.path.join(root, "summary.md"), text)
    write_text(os.path.join(root, "summary.csv"), to_csv(*table(runs)))
    if numbers is not None:
        write_text(os.path.join(root, repeat_stats.STATS_FILE), json.dumps(numbers, indent=2) + "\n")
    if runs:
        plot(runs, os.path.join(root, "summary.png"))
    return runs


def _no_runs(root: str) -> str:
    """The sentence refusing a folder without runs; a single run's workdir is named as such."""
    if os.path.isfile(os.path.join(root, "metrics.jsonl")):
        return (f"{root} is one run's workdir, not a sweep's root (its results are in its summary.md); pass the "
                "folder that holds the runs (the --root given to jaxrat sweep).")
    return (f"{root} holds no runs (no <name>/metrics.jsonl); run the sweep first, or pass the sweep's root "
            "folder (the --root given to jaxrat sweep).")


def report(root: str) -> str:
    """Write the summary files of ``root``; the markdown table and where the files are, for printing.

    A folder without runs is refused before anything is written: a run's workdir passed by mistake
    keeps its own ``summary.md``."""
    if not os.path.isdir(root):
        raise UserError(f"{root} is not a folder; pass the sweep's root folder (the --root given to jaxrat sweep).")
    runs = collect(root)
    if not runs:
        raise UserError(_no_runs(root))
    write_summary(root, runs)
    files = [f for f in ("summary.md", "summary.csv", "summary.png", repeat_stats.STATS_FILE)
             if os.path.exists(os.path.join(root, f))]
    text, _ = study_markdown(root, runs)
    return text + f"\nwritten: {', '.join(os.path.join(root, f) for f in files)}\n"
