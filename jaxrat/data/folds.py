"""K-fold cross-validation of the training split (``config.data.folds`` / ``fold`` / ``fold_seed`` / ``fold_dir``).

With ``folds = K > 0`` the training split's items are dealt into K folds, deterministically from
their ids (and their classes, where the task has some: every fold then holds each class in the
same proportion, within one item); fold ``data.fold`` becomes the validation split and the other
K - 1 folds the training split. The dataset's own validation split is not used.

The assignment depends only on the items' ids, their classes, K and ``fold_seed``, so every run
of a sweep computes the same one; the first writes it to
``fold_dir/folds-K<K>-seed<S>-<digest>.json`` (the digest is that of the ids and classes: a
dataset that differs, e.g. synthetic data drawn with another seed, gets its own file) and the
others check theirs against it, so the file is the record of which image was in which fold.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
from typing import Any, Sequence

import numpy as np

from jaxrat.runtime.errors import ConfigError, DataError
from jaxrat.runtime.fileio import write_json


def settings(data_cfg: Any) -> tuple[int, int, int, str]:
    """(K, fold, seed, fold_dir) of ``config.data``; K is 0 when cross-validation is off."""
    get = data_cfg.get if hasattr(data_cfg, "get") else lambda k, d=None: getattr(data_cfg, k, d)
    k, fold = int(get("folds", 0) or 0), int(get("fold", 0) or 0)
    if k < 0 or k == 1:
        raise ConfigError(f"config.data.folds={k}; use 0 (the dataset's own validation split) or K >= 2 folds.")
    if k and not 0 <= fold < k:
        raise ConfigError(f"config.data.fold={fold} is not one of the {k} folds; use 0 to {k - 1}.")
    return k, fold, int(get("fold_seed", 0) or 0), str(get("fold_dir", "") or "")


def assign(ids: Sequence[str], k: int, seed: int, classes: Sequence[int] | None = None) -> list[int]:
    """The fold of each item (in the order of ``ids``): within each class (all items when
    ``classes`` is None), the items sorted by id, shuffled by ``seed`` and dealt round-robin, the
    next class continuing the deal where the last one stopped, so fold sizes differ by at most one."""
    if len(set(ids)) != len(ids):
        raise DataError("The training split lists an item twice; cross-validation needs unique items.")
    if len(ids) < k:
        raise ConfigError(f"config.data.folds={k} but the training split has only {len(ids)} items; use fewer folds.")
    rng = np.random.default_rng(seed)
    strata = classes if classes is not None else [0] * len(ids)
    fold = [0] * len(ids)
    dealt = 0
    for c in sorted(set(strata)):
        members = sorted((i for i in range(len(ids)) if strata[i] == c), key=lambda i: ids[i])
        for j in rng.permutation(len(members)):
            fold[members[j]] = dealt % k
            dealt += 1
    return fold


def _digest(ids: Sequence[str], classes: Sequence[int] | None) -> str:
    h = hashlib.sha256(json.dumps([list(ids), None if classes is None else list(classes)]).encode())
    return h.hexdigest()[:12]


def record(fold_dir: str, ids: Sequence[str], classes: Sequence[int] | None, k: int, seed: int,
           folds: list[int]) -> str:
    """Write (once) or check the assignment file under ``fold_dir``; returns its path."""
    path = os.path.join(fold_dir, f"folds-K{k}-seed{seed}-{_digest(ids, classes)}.json")
    content = {"k": k, "seed": seed, "stratified": classes is not None, "ids": list(ids), "fold": folds,
               "classes": None if classes is None else list(classes)}
    if os.path.exists(path):
        try:
            with open(path) as f:
                written = json.load(f)
        except ValueError:
            written = None
        if written is not None and written.get("fold") != folds:
            raise DataError(f"{path} assigns the items to other folds than this run computes; delete it or point "
                            "--config.data.fold_dir elsewhere.")
        if written is not None:
            return path
    others = sorted(glob.glob(os.path.join(fold_dir, f"folds-K{k}-seed{seed}-*.json")))
    if others:  # the same folds of other items: the dataset changed, and the deal with it
        logging.warning("data: the items differ from those of %s (%d of them now), so the %d folds are dealt anew "
                        "and a run resumed on them trains on another split; keep the dataset as it was for a "
                        "resume, or compare runs of one assignment only", others[-1], len(ids), k)
    os.makedirs(fold_dir, exist_ok=True)
    write_json(path, content)  # runs of a job array may write it at once: each its own temporary
    return path


def split(items: list, ids: Sequence[str], data_cfg: Any, *, classes: Sequence[int] | None = None,
          process_index: int = 0, workdir: str = "") -> tuple[list, list] | None:
    """(train items, validation items) of fold ``data.fold``, or None when ``data.folds`` is 0."""
    k, fold, seed, fold_dir = settings(data_cfg)
    if not k:
        return None
    folds = assign(ids, k, seed, classes)
    if process_index == 0:
        path = record(fold_dir or workdir, ids, classes, k, seed, folds)
        logging.info("data: fold %d of %d%s (assignment: %s)", fold, k, ", stratified by class" if classes else "",
                     path)
    train = [x for x, f in zip(items, folds) if f != fold]
    val = [x for x, f in zip(items, folds) if f == fold]
    return train, val
