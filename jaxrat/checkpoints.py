"""Read checkpoint folders without training: list, pick best/latest, resolve ``PATH[:STEP]``.

``python -m jaxrat.checkpoints WORKDIR`` prints one row per complete checkpoint: step, size on
disk, why it was saved, its eval metrics, and which one is latest and best. Folders of a save that
never finished are listed as incomplete (the next training start deletes them).

A checkpoint counts as complete only when its ``commit_success.txt`` exists: Orbax writes it last
in both atomicity modes (atomic rename and in-place commit file), so this reader never offers a
half-written checkpoint whichever mode wrote it.
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Any

from jaxrat.errors import UserError

BEST_FILE = "best.json"  # {"step", "metric", "mode", "value"}: written by process 0 after commits
COMMIT_FILE = "commit_success.txt"
_STEP_RE = re.compile(r"^\d+$")


def checkpoint_dir(path: str) -> str:
    """The folder holding ``<step>/`` folders, given it or a workdir that has ``checkpoints/``."""
    path = os.path.abspath(os.path.expanduser(path))
    sub = os.path.join(path, "checkpoints")
    if os.path.isdir(sub):
        return sub
    if os.path.isdir(path):
        return path
    raise UserError(f"No checkpoints at {path}; pass a training workdir or its checkpoints/ folder.")


def committed_steps(directory: str) -> list[int]:
    """Steps whose save finished (commit marker present), ascending."""
    if not os.path.isdir(directory):
        return []
    return sorted(
        int(n) for n in os.listdir(directory)
        if _STEP_RE.match(n) and os.path.isfile(os.path.join(directory, n, COMMIT_FILE))
    )


def incomplete_entries(directory: str) -> list[str]:
    """Names of save folders that never committed (a killed or running save)."""
    if not os.path.isdir(directory):
        return []
    out = []
    for n in sorted(os.listdir(directory)):
        full = os.path.join(directory, n)
        if ".orbax-checkpoint-tmp" in n or (_STEP_RE.match(n) and not os.path.isfile(os.path.join(full, COMMIT_FILE))):
            out.append(n)
    return out


def step_metadata(directory: str, step: int) -> dict[str, Any]:
    """What jaxrat stored with a step (reason, metrics, eval_pending, topology); {} if unreadable."""
    try:
        with open(os.path.join(directory, str(step), "_CHECKPOINT_METADATA")) as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return {}
    meta = dict(raw.get("custom_metadata") or {})
    if raw.get("commit_timestamp_nsecs"):
        meta["committed_at"] = raw["commit_timestamp_nsecs"] / 1e9
    return meta


def _size(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total


def best_step(directory: str) -> tuple[int, dict[str, Any]] | None:
    """(step, pointer) of the best committed checkpoint, or None when none was ranked.

    Trusts ``best.json`` when it names a committed step; otherwise (a crash before the pointer was
    rewritten, or a filesystem whose rename is not atomic) ranks the steps' stored metrics again.
    """
    steps = committed_steps(directory)
    try:
        with open(os.path.join(directory, BEST_FILE)) as f:
            pointer = json.load(f)
        if int(pointer["step"]) in steps:
            return int(pointer["step"]), pointer
    except (OSError, ValueError, KeyError, TypeError):
        pass
    ranked = []
    for step in steps:
        meta = step_metadata(directory, step)
        name, mode = meta.get("best_metric"), meta.get("best_mode", "max")
        value = (meta.get("metrics") or {}).get(name) if name else None
        if value is not None:
            pointer = {"step": step, "metric": name, "mode": mode, "value": value}
            ranked.append((value if mode == "max" else -value, step, pointer))
    if not ranked:
        return None
    _, step, pointer = max(ranked)
    return step, pointer


def resolve(spec: str) -> tuple[str, int]:
    """``PATH[:STEP|:best|:latest]`` -> (checkpoint folder, step); latest when no step is given.

    PATH may be a workdir, its ``checkpoints/`` folder, or one ``<step>/`` folder.
    """
    path, step_spec = spec, ""
    head, sep, tail = spec.rpartition(":")
    if sep and (tail.isdigit() or tail in ("best", "latest")):
        path, step_spec = head, tail
    path = os.path.abspath(os.path.expanduser(path))
    if _STEP_RE.match(os.path.basename(path.rstrip("/"))) and not os.path.isdir(os.path.join(path, "checkpoints")):
        path, implied = os.path.dirname(path.rstrip("/")), os.path.basename(path.rstrip("/"))
        step_spec = step_spec or implied
    directory = checkpoint_dir(path)
    steps = committed_steps(directory)
    if not steps:
        raise UserError(f"{directory} holds no complete checkpoint; point init_from at a run that saved one.")
    if step_spec in ("", "latest"):
        return directory, steps[-1]
    if step_spec == "best":
        best = best_step(directory)
        if best is None:
            raise UserError(
                f"{directory} has no ranked checkpoint (no eval metric was saved with one); "
                f"use :latest or a step number ({', '.join(map(str, steps))})."
            )
        return directory, best[0]
    if int(step_spec) not in steps:
        raise UserError(
            f"{directory} has no complete checkpoint at step {step_spec}; available: {', '.join(map(str, steps))}."
        )
    return directory, int(step_spec)


def describe(path: str) -> dict[str, Any]:
    """Everything the CLI prints, as data: rows per step, latest, best, incomplete folders."""
    directory = checkpoint_dir(path)
    steps = committed_steps(directory)
    best = best_step(directory)
    rows = []
    for step in steps:
        meta = step_metadata(directory, step)
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
        "incomplete": incomplete_entries(directory),
    }


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _columns(info: dict[str, Any]) -> list[str]:
    # The ranked metric first, then the usual segmentation ones; --json has every metric.
    present = {k for r in info["steps"] for k in r["metrics"]}
    first = [info["best"]["metric"]] if info["best"] else []
    preferred = first + ["eval/dice", "eval/iou", "eval/loss"]
    return [n for i, n in enumerate(preferred) if n in present and n not in preferred[:i]][:4]


def format_table(info: dict[str, Any]) -> str:
    """The listing as text: one row per step, then latest/best/incomplete lines."""
    lines = [f"checkpoints in {info['directory']}"]
    if not info["steps"]:
        lines.append("  (no complete checkpoint)")
    else:
        names = _columns(info)
        head = [f"{'step':>8}", f"{'size':>10}", f"{'saved for':<11}", *[f"{n:>12}" for n in names], "mark"]
        lines.append("  " + "  ".join(head))
        best = info["best"]["step"] if info["best"] else None
        for r in info["steps"]:
            marks = [m for m, hit in (("latest", r["step"] == info["latest"]), ("best", r["step"] == best),
                                      ("eval pending", r["eval_pending"])) if hit]
            vals = [f"{r['metrics'][n]:>12.4f}" if n in r["metrics"] else f"{'-':>12}" for n in names]
            cells = [f"{r['step']:>8}", f"{_human(r['bytes']):>10}", f"{r['reason']:<11}", *vals, ",".join(marks)]
            lines.append("  " + "  ".join(cells))
    lines.append(f"latest: {info['latest'] if info['latest'] is not None else '-'}")
    if info["best"]:
        b = info["best"]
        lines.append(f"best: {b['step']} ({b['metric']} {b['value']:.4f}, {b['mode']}); "
                     f"restore with --config.init_from=WORKDIR:best")
    else:
        lines.append("best: - (none ranked: needs checkpoint.best_metric, e.g. eval/dice, and an eval at a "
                     "saved step)")
    if info["incomplete"]:
        lines.append(f"incomplete (never committed, deleted at the next start): {', '.join(info['incomplete'])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m jaxrat.checkpoints WORKDIR [--json]``."""
    import argparse

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
