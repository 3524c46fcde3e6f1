"""Which checkpoint a command that reads a trained run uses when none is named: the best one
(``checkpoints/best.json``, ranked by ``checkpoint.best_metric``) when the run has one, else the
latest; and the line that says which."""

from __future__ import annotations

import logging

from jaxrat.checkpointing.store import best_step, checkpoint_dir, committed_steps
from jaxrat.runtime.errors import UserError

AUTO = ""  # the --step default: best when ranked, else latest


def check_step(step: str) -> None:
    """Refuse a --step that is neither a step number, "latest", "best" nor :data:`AUTO` (before anything is written)."""
    if not (step == AUTO or step.isdigit() or step in ("best", "latest")):
        raise UserError(f"--step {step} names no checkpoint; pass a step number (0 or more), latest or best.")


def choose(workdir: str, step: str) -> str:
    """``step`` as given (checked by :func:`check_step`), or for :data:`AUTO` "best" or "latest" (logged:
    which step, and why)."""
    check_step(step)
    if step != AUTO:
        return step
    directory = checkpoint_dir(workdir)
    best = best_step(directory)
    if best is not None:
        pointer = best[1]
        value = pointer.get("value")
        shown = f"{pointer.get('metric')} {value:.4g}" if isinstance(value, (int, float)) else pointer.get("metric")
        logging.info("checkpoint: the best, step %d (%s); --step latest or --step N picks another", best[0], shown)
        return "best"
    steps = committed_steps(directory)
    if steps:
        logging.info("checkpoint: the latest, step %d (the run ranked none as best)", steps[-1])
    return "latest"
