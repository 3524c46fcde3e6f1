"""``WORKDIR/labels.json``: what each output of a trained model means, kept with the run beside its
``config.json``.

A task whose label names come from the data (a table's text labels in sorted order, class folders,
the categories of an annotation file) says them in ``task.label_space()``, so output 0 means
whatever the dataset says when it is read. Kept with the run, the names let ``predict`` and
``export`` name classes without the dataset (moved, or on another machine), and a dataset whose
labels changed since training (a class added to the table shifts every name after it) is refused
instead of naming each output after another class. Tasks whose names are in the config
(``task.class_names``) have no label space and write nothing.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from jaxrat.runtime.errors import DataError

LABELS_NAME = "labels.json"


def saved(workdir: str) -> dict[str, Any] | None:
    """The label space a run in ``workdir`` was trained with; None for runs from before this file, or
    of tasks without one (an unreadable file is said and ignored)."""
    path = os.path.join(workdir, LABELS_NAME)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        logging.warning("%s is unreadable (%s); the label names are read from the dataset again", path, e)
        return None


def of(task: Any) -> dict[str, Any] | None:
    """The label space of ``task`` (its data prepared): what ``labels.json`` keeps; None for a task
    whose names are in the config."""
    method = getattr(task, "label_space", None)
    return method() if method is not None else None


def check(space: dict[str, Any] | None, workdir: str, *, fix: str) -> None:
    """Stop when ``space`` (:func:`of` the task, as its data reads now) differs from the labels the run
    in ``workdir`` was trained with; ``fix`` ends the sentence (what to do instead)."""
    before = saved(workdir)
    if before is None or space is None or before == space:
        return
    raise DataError(f"The labels of the data differ from those the run in {workdir} was trained with "
                    f"({describe_change(before, space)}), so its outputs would be named after other classes; {fix}.")


def describe_change(before: dict[str, Any], now: dict[str, Any]) -> str:
    """The first difference of two label spaces, e.g. "head 'kind': 3 classes a, b, c -> 4 classes ..."."""
    for head in sorted(set(before.get("heads", {})) | set(now.get("heads", {}))):
        a, b = before.get("heads", {}).get(head), now.get("heads", {}).get(head)
        if a != b:
            return f"head {head!r}: {_classes(a)} -> {_classes(b)}"
    a, b = before.get("categories"), now.get("categories")
    return f"categories {_categories(a)} -> {_categories(b)}"


def _classes(head: dict[str, Any] | None) -> str:
    if head is None:
        return "none"
    names = head.get("names") or []
    shown = ", ".join(map(str, names[:6])) + (", ..." if len(names) > 6 else "")
    return f"{head.get('classes')} classes" + (f" {shown}" if shown else " (numbers)")


def _categories(cats: list[dict[str, Any]] | None) -> str:
    if not cats:
        return "none"
    return ", ".join(f"{c['id']} {c['name']}" for c in cats[:6]) + (", ..." if len(cats) > 6 else "")
