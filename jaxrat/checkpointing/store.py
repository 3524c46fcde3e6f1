"""Facts about a checkpoint folder, read without Orbax: which steps committed, what they store, best, specs.

A checkpoint counts as complete only when its ``commit_success.txt`` exists: Orbax writes it last
in both atomicity modes (atomic rename and in-place commit file), so nothing here ever offers a
half-written checkpoint whichever mode wrote it. Everything in this module only reads.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from jaxrat.runtime.errors import UserError

BEST_FILE = "best.json"  # {"step", "metric", "mode", "value"}: written by process 0 after commits
COMMIT_FILE = "commit_success.txt"
METADATA_FILE = "_CHECKPOINT_METADATA"
# Unreadable checkpoints are moved here as ``<step>-<UTC time>``: not a step name, so Orbax's manager,
# its start-up cleanup (which removes only ``*.orbax-checkpoint-tmp*``) and ``committed_steps`` skip it.
DAMAGED_DIR = "damaged"
EARLY_STOP_KEY = "early_stop"  # a step's metadata entry of the loop's early stopping state
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


def damaged_entries(directory: str) -> list[str]:
    """Checkpoints found unreadable and moved aside, as paths relative to ``directory``, by step."""
    aside = os.path.join(directory, DAMAGED_DIR)
    if not os.path.isdir(aside):
        return []
    names = sorted(os.listdir(aside), key=lambda n: (_leading_int(n), n))
    return [os.path.join(DAMAGED_DIR, n) for n in names]


def _leading_int(name: str) -> int:
    head = name.split("-", 1)[0]
    return int(head) if head.isdigit() else -1


def step_metadata(directory: str, step: int | str) -> dict[str, Any]:
    """What jaxrat stored with a step (reason, metrics, eval_pending, topology); {} if unreadable.

    ``step`` may also be a folder name relative to ``directory``, e.g. one of :func:`damaged_entries`.
    """
    try:
        with open(os.path.join(directory, str(step), METADATA_FILE)) as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(raw, dict):
        return {}
    meta = dict(raw.get("custom_metadata") or {})
    if raw.get("commit_timestamp_nsecs"):
        meta["committed_at"] = raw["commit_timestamp_nsecs"] / 1e9
    return meta


def stopped_early(meta: dict[str, Any]) -> bool:
    """Whether a step's metadata says early stopping ended the run there (the run is finished)."""
    return bool((meta.get(EARLY_STOP_KEY) or {}).get("stopped"))


def rank(value: float, step: int, mode: str) -> tuple[float, int]:
    """The one order of "best" (the largest wins): the higher value (``mode`` "max") or the lower
    ("min"), and on a tie the later step, which is the one Orbax's keep-best keeps. The pointer,
    its fallback, the run summary and the sweep tables all rank with it, so they name one step."""
    return (value if mode == "max" else -value, step)


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
            ranked.append((rank(value, step, mode), pointer))
    if not ranked:
        return None
    pointer = max(ranked, key=lambda r: r[0])[1]
    return pointer["step"], pointer


def split_spec(spec: str) -> tuple[str, str]:
    """``PATH[:STEP|:best|:latest]`` -> (PATH, the step part or ""); a colon inside PATH stays in it."""
    head, sep, tail = spec.rpartition(":")
    if sep and (tail.isdigit() or tail in ("best", "latest")):
        return head, tail
    return spec, ""


def resolve(spec: str) -> tuple[str, int]:
    """``PATH[:STEP|:best|:latest]`` -> (checkpoint folder, step); latest when no step is given.

    PATH may be a workdir, its ``checkpoints/`` folder, or one ``<step>/`` folder.
    """
    path, step_spec = split_spec(spec)
    path = os.path.abspath(os.path.expanduser(path))
    if _STEP_RE.match(os.path.basename(path.rstrip("/"))) and not os.path.isdir(os.path.join(path, "checkpoints")):
        path, implied = os.path.dirname(path.rstrip("/")), os.path.basename(path.rstrip("/"))
        step_spec = step_spec or implied
    directory = checkpoint_dir(path)
    steps = committed_steps(directory)
    if not steps:
        raise UserError(f"{directory} holds no complete checkpoint; train that run first, or name a run "
                        f"that saved one.")
    if step_spec in ("", "latest"):
        return directory, steps[-1]
    if step_spec == "best":
        best = best_step(directory)
        if best is None:
            raise UserError(
                f"{directory} has no ranked checkpoint (no eval metric was saved with one); "
                f"ask for the latest or a step number ({', '.join(map(str, steps))}) instead."
            )
        return directory, best[0]
    if int(step_spec) not in steps:
        raise UserError(
            f"{directory} has no complete checkpoint at step {step_spec}; available: {', '.join(map(str, steps))}."
        )
    return directory, int(step_spec)
