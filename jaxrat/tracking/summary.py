"""The run summary: ``WORKDIR/summary.json`` and a short ``WORKDIR/summary.md`` for people.

The trainer assembles the content (:mod:`jaxrat.trainer.run_summary`); this module only writes it,
atomically, so a reader never sees half a summary.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

from jaxrat.runtime.fileio import write_text

JSON_NAME, MARKDOWN_NAME = "summary.json", "summary.md"


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


def _score(v: Any) -> str:
    """A metric with four decimals kept (0.9700, not 0.97, which reads as rounded to 2 digits)."""
    if isinstance(v, float) and (v == 0 or 1e-3 <= abs(v) < 1e4):
        return f"{v:.4f}"
    return _fmt(v)


def _table(rows: Mapping[str, Any], fmt: Any = _fmt) -> list[str]:
    return ["| | |", "|---|---|", *(f"| {k} | {fmt(v)} |" for k, v in rows.items())]


def markdown(s: Mapping[str, Any]) -> str:
    """A page: the run at a glance, its metrics, its checkpoints (the config stays in the JSON)."""
    hw, steps, ck = s.get("hardware", {}), s.get("steps", {}), s.get("checkpoints", {})
    best = s.get("best") or {}
    lines = [f"# Run summary: {s.get('workdir', '')}", "", f"Status: **{s.get('status', '')}**", ""]
    if s.get("stopped_early"):
        lines += [f"Stopped early at step {s['stopped_early'].get('step')}: {s['stopped_early'].get('reason')}.", ""]
    lines += _table({
        "task / model": f"{s.get('task', '')} / {s.get('model', '')}",
        "steps": f"{steps.get('first', '')} -> {steps.get('last', '')} of {steps.get('total', '')}",
        "wall time (s)": s.get("wall_time_s"),
        "images/s": s.get("images_per_sec"),
        "global batch": s.get("global_batch"),
        "hardware": f"{hw.get('device_count', '')} x {hw.get('device_kind', '')} ({hw.get('backend', '')}) in "
                    f"{hw.get('process_count', '')} process(es)",
        "mesh": s.get("mesh"),
        "best": f"{best.get('metric')} {_score(best.get('value'))} at step {best.get('step')}" if best else "",
    })
    for title, key in (("Last eval", "last_eval"), ("Last train window", "last_train")):
        if s.get(key):
            lines += ["", f"## {title}", "", *_table(s[key], _score)]
    if ck:
        lines += ["", "## Checkpoints", "", *_table({k: v for k, v in ck.items() if v})]
    if s.get("plots"):
        lines += ["", "## Plots", ""] + [f"![{name}]({name})" for name in s["plots"]]
    return "\n".join(lines) + "\n"


def write_summary(workdir: str, summary: Mapping[str, Any]) -> list[str]:
    """Write ``summary.json`` and ``summary.md`` under ``workdir``; returns their paths."""
    paths = [os.path.join(workdir, JSON_NAME), os.path.join(workdir, MARKDOWN_NAME)]
    # Both rendered before either is written: a summary that cannot be rendered leaves neither file.
    texts = [json.dumps(summary, indent=2, sort_keys=True, default=str) + "\n", markdown(summary)]
    for path, text in zip(paths, texts):
        write_text(path, text)
    return paths
