"""The pictures a finished run leaves beside its summary: ``curves.png`` (training loss, learning
rate and the eval metrics over the steps, from ``metrics.jsonl``) and, for classification, each
head's confusion matrix (``confusion_<head>.png``). matplotlib draws off-screen (Agg)."""

from __future__ import annotations

import json
import os
import textwrap
from typing import Any, Mapping, Sequence

import numpy as np

CURVES_NAME = "curves.png"
# Eval metrics drawn when present, in this order (a task's own others follow, up to the panel count).
_PREFERRED = ("eval/dice", "eval/iou", "eval/top1", "eval/AP", "eval/AP50", "eval/accuracy", "eval/loss")


def read_rows(path: str) -> list[dict]:
    """metrics.jsonl's rows; a resumed run re-logs steps, the last row of a step wins."""
    by_step: dict[int, dict] = {}
    try:
        with open(path) as f:
            for line in f:
                try:
                    row = json.loads(line)
                except ValueError:
                    continue  # a line cut by a full disk
                if isinstance(row, dict) and "step" in row:
                    by_step.setdefault(int(row["step"]), {}).update(row)
    except OSError:
        return []
    return [by_step[s] for s in sorted(by_step)]


def _series(rows: Sequence[Mapping], key: str) -> tuple[list[int], list[float]]:
    pts = [(int(r["step"]), float(r[key])) for r in rows if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def eval_keys(rows: Sequence[Mapping], best_metric: str = "", limit: int = 4,
              foreground: Sequence[str] = ()) -> list[str]:
    """The eval metrics to draw: the ranked one first, then the usual ones, then the task's others.
    ``foreground``: a multi-class segmentation's foreground class names: then the classes' mean
    Dice (``eval/dice``) and each foreground class's (``eval/dice/<class>``), never the background's."""
    present = {k for r in rows for k in r if k.startswith("eval/") and not k.startswith("eval/orig/")
               and isinstance(r[k], (int, float)) and k != "eval/num_images"}
    per_class = [f"eval/dice/{c}" for c in foreground if f"eval/dice/{c}" in present]
    if per_class:
        mean = [k for k in (best_metric, "eval/dice") if k in present and not k.startswith("eval/dice/")]
        return list(dict.fromkeys(mean)) + per_class[:max(limit, 8)]
    order = [best_metric] if best_metric in present else []
    order += [k for k in _PREFERRED if k in present and k not in order]
    order += sorted(present - set(order))
    return order[:limit]


def write_curves(workdir: str, best_metric: str = "", foreground: Sequence[str] = ()) -> str | None:
    """``WORKDIR/curves.png`` from ``WORKDIR/metrics.jsonl``; None when there is nothing to draw.
    ``foreground``: see :func:`eval_keys`."""
    rows = read_rows(os.path.join(workdir, "metrics.jsonl"))
    panels = [k for k in ("train/loss", "train/learning_rate") if _series(rows, k)[0]]
    panels += eval_keys(rows, best_metric, foreground=foreground)
    if not panels:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(3, len(panels))
    fig, axes = plt.subplots(-(-len(panels) // cols), cols, figsize=(4.2 * cols, 3.2 * -(-len(panels) // cols)),
                             squeeze=False)
    for ax, key in zip(axes.flat, panels):
        steps, values = _series(rows, key)
        ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3)
        if key == "train/learning_rate":
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
        ax.set_title("eval/dice (foreground classes' mean)" if key == "eval/dice" and foreground else key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    path = os.path.join(workdir, CURVES_NAME)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def write_confusion(workdir: str, head: str, confusion: np.ndarray, labels: Sequence[str] = ()) -> str:
    """``WORKDIR/confusion_<head>.png``: counts, coloured by the share of each true class."""
    import matplotlib.pyplot as plt

    fig = confusion_figure(head, confusion, labels)
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in head)
    path = os.path.join(workdir, f"confusion_{safe}.png")
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def confusion_figure(head: str, confusion: np.ndarray, labels: Sequence[str] = ()) -> Any:
    """The matplotlib figure :func:`write_confusion` saves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    conf = np.asarray(confusion, np.float64)
    n = conf.shape[0]
    rows = conf / np.maximum(conf.sum(1, keepdims=True), 1)
    side = min(12.0, 2.5 + 0.45 * n)
    fig, ax = plt.subplots(figsize=(side, side))
    ax.imshow(rows, cmap="Blues", vmin=0, vmax=1)
    names = list(labels) if len(labels) == n else [str(i) for i in range(n)]
    if n <= 30:
        ax.set_xticks(range(n), names, rotation=90)
        ax.set_yticks(range(n), names)
        for i in range(n):
            for j in range(n):
                if conf[i, j]:
                    ax.text(j, i, f"{int(conf[i, j])}", ha="center", va="center", fontsize=7,
                            color="white" if rows[i, j] > 0.5 else "black")
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    # Wrapped to the figure's width: a long head name in one line ran past a small matrix's edges.
    ax.set_title(textwrap.fill(f"{head}: confusion (rows: true class)", max(16, int(side * 7))), fontsize=10)
    fig.tight_layout()
    return fig
