"""List a run's checkpoints without training: ``python -m jaxrat.checkpoints WORKDIR [--json]``.

One row per complete checkpoint: step, size on disk, why it was saved, its eval metrics, and which
one is latest and best. Folders of a save that never finished are listed as incomplete (the next
training start deletes them), and checkpoints a restore found unreadable and moved to ``damaged/``
as damaged. This module only reads, and library code does not import it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from jaxrat.checkpointing import store
from jaxrat.runtime.errors import UserError

MAX_METRIC_COLUMNS = 4


def describe(path: str) -> dict[str, Any]:
    """Everything the CLI prints, as data: rows per step, latest, best, incomplete and damaged folders."""
    directory = store.checkpoint_dir(path)
    _check_is_run(directory)
    steps = store.committed_steps(directory)
    best = store.best_step(directory)
    rows = []
    for step in steps:
        meta = store.step_metadata(directory, step)
        rows.append({
            "step": step,
            "bytes": _size(os.path.join(directory, str(step))),
            "reason": meta.get("reason", ""),
            "metrics": meta.get("metrics") or {},
            "eval_pending": bool(meta.get("eval_pending")),
            "processes": meta.get("process_count"),
            "devices": meta.get("device_count"),
            "committed_at": meta.get("committed_at"),
        })
    return {
        "directory": directory,
        "steps": rows,
        "latest": steps[-1] if steps else None,
        "best": best[1] if best else None,
        "incomplete": store.incomplete_entries(directory),
        "damaged": store.damaged_entries(directory),
    }


def _check_is_run(directory: str) -> None:
    """Refuse a folder that is neither a run's workdir nor its checkpoints/ folder: a listing of "no
    complete checkpoint" said nothing of a folder of images, or of one step's folder passed by mistake."""
    if os.path.basename(directory) == "checkpoints" or os.path.isfile(os.path.join(directory, "config.json")):
        return
    names = os.listdir(directory)
    if any(n.isdigit() or n in ("damaged", "best.json") for n in names):
        return
    if store.COMMIT_FILE in names or "state" in names:
        run = os.path.dirname(os.path.dirname(directory))
        raise UserError(f"{directory} is one checkpoint (step {os.path.basename(directory)}), not a run; pass the "
                        f"run's workdir, {run}.")
    raise UserError(f"{directory} is not a training run (no checkpoints/ folder, no config.json, no step folders); "
                    f"pass a run's --workdir.")


def _size(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _columns(info: dict[str, Any]) -> list[str]:
    # The ranked metric first, then the others by name, whatever the task; --json has every metric.
    present = sorted({k for r in info["steps"] for k in r["metrics"]})
    ranked = info["best"]["metric"] if info["best"] else None
    first = [ranked] if ranked in present else []
    return (first + [n for n in present if n != ranked])[:MAX_METRIC_COLUMNS]


def format_table(info: dict[str, Any]) -> str:
    """The listing as text: one row per step, then latest/best/incomplete lines."""
    lines = [f"checkpoints in {info['directory']}"]
    if not info["steps"]:
        lines.append("  (no complete checkpoint)")
    else:
        names = _columns(info)
        width = max([12, *(len(n) for n in names)])
        head = [f"{'step':>8}", f"{'size':>10}", f"{'saved for':<11}", *[f"{n:>{width}}" for n in names], "mark"]
        lines.append("  " + "  ".join(head))
        best = info["best"]["step"] if info["best"] else None
        for r in info["steps"]:
            marks = [m for m, hit in (("latest", r["step"] == info["latest"]), ("best", r["step"] == best),
                                      ("eval pending", r["eval_pending"])) if hit]
            vals = [f"{r['metrics'][n]:>{width}.4f}" if n in r["metrics"] else f"{'-':>{width}}" for n in names]
            cells = [f"{r['step']:>8}", f"{_human(r['bytes']):>10}", f"{r['reason']:<11}", *vals, ",".join(marks)]
            lines.append("  " + "  ".join(cells))
    lines.append(f"latest: {info['latest'] if info['latest'] is not None else '-'}")
    if info["best"]:
        b = info["best"]
        lines.append(f"best: {b['step']} ({b['metric']} {b['value']:.4f}, {b['mode']}); "
                     f"restore with --config.init_from=WORKDIR:best")
    else:
        lines.append("best: - (none ranked: needs checkpoint.best_metric, e.g. eval/loss, and an eval at a "
                     "saved step)")
    if info["incomplete"]:
        lines.append(f"incomplete (never committed, deleted at the next start): {', '.join(info['incomplete'])}")
    if info.get("damaged"):
        lines.append(f"damaged (found unreadable at a restore, moved aside, never restored): "
                     f"{', '.join(info['damaged'])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m jaxrat.checkpoints WORKDIR [--json]``; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m jaxrat.checkpoints", description=__doc__.split("\n")[0])
    parser.add_argument("workdir", help="a training workdir or its checkpoints/ folder")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    try:
        info = describe(args.workdir)
    except UserError as e:
        print(f"jaxrat: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(info, indent=2) if args.json else format_table(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
