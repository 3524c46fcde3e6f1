"""Resolution-transfer robustness: one trained checkpoint scored over a grid of input sizes and
spacings, tabulated against the training resolution.

A grid point ``(size, spacing)`` is the run's own evaluation with ``data.image_size = size`` (every
image resized to ``size`` like real data; synthetic data stays at the size it was generated at)
and ``data.eval_spacing = spacing`` (each resized image downsampled by ``spacing`` and upsampled
back: the same field of view recorded at ``spacing`` times the pixel size, so detail is lost but
the grid the model sees is unchanged). The reference is the training resolution at spacing 1;
every metric's relative change is ``(value - reference) / |reference|``.

The evaluation itself is passed in (``evaluate``: :func:`jaxrat.trainer.evaluation.evaluate_checkpoint`
from the entry point), so this module only plans the grid and writes the results:
``DIR/robustness/{table.md,table.csv,table.json,plot.png}`` plus each point's ``metrics.json``
under ``DIR/robustness/points/``.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
from typing import Any, Callable, Sequence

import ml_collections as mlc

from jaxrat.checkpointing.reading import Opened, open_checkpoint
from jaxrat.runtime.errors import ConfigError, UserError
from jaxrat.runtime.fileio import save_figure, write_csv, write_text

OUT_DIR = "robustness"
FILES = ("table.md", "table.csv", "table.json", "plot.png")
# (config, workdir, step, *, out_dir, data_dir) -> (step, {"eval/<metric>": value})
Evaluate = Callable[..., tuple[int, dict[str, float]]]


def parse_sizes(text: str) -> list[int]:
    """``"128,192,256"`` -> ``[128, 192, 256]`` (positive integers, duplicates dropped, order kept)."""
    try:
        sizes = [int(s) for s in text.replace(" ", "").split(",") if s]
    except ValueError:
        raise ConfigError(f"--sizes={text}: write sizes in pixels separated by commas, e.g. 128,192,256.") from None
    if not sizes or min(sizes) < 1:
        raise ConfigError(f"--sizes={text}: give at least one positive size in pixels, e.g. 128,192,256.")
    return list(dict.fromkeys(sizes))


def parse_spacings(text: str) -> list[float]:
    """``"1,2,4"`` -> ``[1.0, 2.0, 4.0]`` (each >= 1: 1 is the image as resized, 2 half its detail)."""
    try:
        spacings = [float(s) for s in text.replace(" ", "").split(",") if s]
    except ValueError:
        raise ConfigError(f"--spacings={text}: write spacing factors separated by commas, e.g. 1,2,4.") from None
    if not spacings or min(spacings) < 1 or not all(math.isfinite(s) for s in spacings):
        raise ConfigError(f"--spacings={text}: give factors of 1 or more (1: as resized, 2: half the detail).")
    return list(dict.fromkeys(spacings))


def point_name(size: int, spacing: float) -> str:
    """Folder name of a grid point, e.g. ``size_128_spacing_2``."""
    return f"size_{size}_spacing_{spacing:g}"


def run_robustness(config: mlc.ConfigDict, workdir: str, *, sizes: Sequence[int], spacings: Sequence[float] = (1.0,),
                   step: str = "latest", evaluate: Evaluate, write: bool = True) -> dict[str, Any]:
    """Evaluate checkpoint ``step`` of ``workdir`` at every (size, spacing) and return the table
    (the content of ``table.json``); ``write`` (process 0) writes the four files.

    ``config`` is the run's config (:func:`jaxrat.config_schema.load_run_config`); the training point
    (its ``data.image_size`` at spacing 1) is always evaluated, as the reference.
    """
    # One checkpoint for every point, held still while a training beside it rotates its checkpoints.
    with open_checkpoint(f"{workdir}:{step}", ("params", "ema_params")) as opened:
        return _run_points(config, workdir, opened, sizes, spacings, evaluate, write)


def _run_points(config: mlc.ConfigDict, workdir: str, opened: Opened, sizes: Sequence[int],
                spacings: Sequence[float], evaluate: Evaluate, write: bool) -> dict[str, Any]:
    train_size, step_number = int(config.data.image_size), opened.step
    grid = [(int(s), float(f)) for s in sizes for f in spacings]
    if (train_size, 1.0) not in grid:
        logging.info("robustness: adding the training resolution %d at spacing 1 (the reference)", train_size)
        grid.insert(0, (train_size, 1.0))
    out = os.path.join(workdir, OUT_DIR)
    rows = []
    for size, spacing in grid:
        point = copy.deepcopy(config)
        point.data.image_size = size
        point.data.eval_spacing = spacing  # added when the run's config predates the field
        logging.info("robustness: size %d, spacing %g", size, spacing)
        try:
            _, metrics = evaluate(point, workdir, str(step_number), out_dir=os.path.join(out, "points",
                                  point_name(size, spacing)), data_dir=out, opened=opened)
        except UserError:
            raise
        except Exception as e:  # a shape the model cannot take surfaces deep inside JAX
            first = (str(e).strip().splitlines() or [""])[0][:200]
            raise ConfigError(f"The model cannot be evaluated at size {size} ({type(e).__name__}: {first}); "
                              f"leave {size} out of --sizes or pick a size its downsampling divides.") from e
        rows.append({"size": size, "spacing": spacing, "metrics": {k: float(v) for k, v in metrics.items()}})
    table = make_table(rows, train_size=train_size, workdir=workdir, step=step_number)
    if write:
        write_outputs(table, out)
    return table


def make_table(rows: list[dict[str, Any]], *, train_size: int, workdir: str = "", step: int = -1) -> dict[str, Any]:
    """Rows sorted by size then spacing, each with ``relative_change`` against the reference row."""
    ref = next(r for r in rows if (r["size"], r["spacing"]) == (train_size, 1.0))["metrics"]
    names = list(ref) + sorted({k for r in rows for k in r["metrics"]} - set(ref))
    out = []
    for r in sorted(rows, key=lambda r: (r["size"], r["spacing"])):
        rel = {k: _relative(r["metrics"].get(k), ref.get(k)) for k in names}
        out.append({**r, "reference": (r["size"], r["spacing"]) == (train_size, 1.0), "relative_change": rel})
    return {"workdir": workdir, "step": step, "train_size": train_size, "metrics": names,
            "sizes": sorted({r["size"] for r in rows}), "spacings": sorted({r["spacing"] for r in rows}), "rows": out}


def _relative(value: float | None, ref: float | None) -> float | None:
    if value is None or ref is None or not (math.isfinite(value) and math.isfinite(ref)):
        return None
    if ref == 0:
        return 0.0 if value == 0 else None  # no scale to measure the change against
    return (value - ref) / abs(ref)


def write_outputs(table: dict[str, Any], out_dir: str) -> list[str]:
    """Write ``table.{md,csv,json}`` and ``plot.png`` to ``out_dir``; return their paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, f) for f in FILES]
    write_text(paths[0], to_markdown(table))
    names = table["metrics"]
    header = ["size", "spacing", "reference"] + [c for m in names for c in (m, f"{m}_rel_change")]
    write_csv(paths[1], ([r["size"], r["spacing"], int(r["reference"])]
                         + [c for m in names for c in (r["metrics"].get(m, ""), _blank(r["relative_change"][m]))]
                         for r in table["rows"]), header)
    write_text(paths[2], json.dumps(table, indent=2) + "\n")
    plot(table, paths[3])
    for p in paths:
        logging.info("wrote %s", p)
    return paths


def _blank(x: float | None) -> Any:
    return "" if x is None else x


def to_markdown(table: dict[str, Any]) -> str:
    """A Markdown table: one row per (size, spacing), each metric with its relative change."""
    names = table["metrics"]
    short = [m.removeprefix("eval/") for m in names]
    lines = [f"Resolution robustness of {table['workdir'] or 'the run'} at step {table['step']} "
             f"(trained at {table['train_size']} px; change relative to it at spacing 1)", "",
             "| size | spacing | " + " | ".join(short) + " |", "|" + "---:|" * (2 + len(names))]
    for r in table["rows"]:
        cells = []
        for m in names:
            v, rel = r["metrics"].get(m), r["relative_change"][m]
            cell = "" if v is None else f"{v:.4g}"
            cells.append(cell if rel is None or r["reference"] else f"{cell} ({rel:+.1%})")
        mark = " (train)" if r["reference"] else ""
        lines.append(f"| {r['size']}{mark} | {r['spacing']:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(table: dict[str, Any], path: str) -> None:
    """One panel per metric that varies over the grid (all metrics if none does): value against
    input size, one line per spacing, the training size dashed."""
    # A bare Figure draws with Agg whatever pyplot's backend is: no display needed on a cluster
    # node, and a notebook's inline plotting is left as it was.
    from matplotlib.figure import Figure

    rows = table["rows"]
    varying = [m for m in table["metrics"] if len({r["metrics"].get(m) for r in rows}) > 1]
    names = varying or table["metrics"]
    cols = min(3, len(names))
    n_rows = -(-len(names) // cols)
    fig = Figure(figsize=(4.2 * cols, 3.2 * n_rows))
    axes = fig.subplots(n_rows, cols, squeeze=False)
    for ax, m in zip(axes.flat, names):
        for spacing in table["spacings"]:
            pts = [(r["size"], r["metrics"][m]) for r in rows if r["spacing"] == spacing and m in r["metrics"]]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o", label=f"spacing {spacing:g}")
        ax.axvline(table["train_size"], color="grey", linestyle="--", linewidth=1)
        ax.set_title(m.removeprefix("eval/"))
        ax.set_xlabel("input size (px)")
        ax.set_xticks(table["sizes"])
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(names):]:
        ax.set_visible(False)
    if len(table["spacings"]) > 1:
        axes.flat[0].legend(fontsize=8)
    fig.suptitle(f"step {table['step']}, trained at {table['train_size']} px (dashed)", fontsize=10)
    fig.tight_layout()
    save_figure(path, fig, dpi=100)
