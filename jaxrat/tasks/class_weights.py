"""Per-class loss weights from the training labels: none, inverse frequency, effective number, or a file."""

from __future__ import annotations

import json
import os

import numpy as np

from jaxrat.runtime.errors import ConfigError

RULES = ("none", "inverse", "effective")


def class_weights(labels: np.ndarray, num_classes: int, rule: str, head: str, *, beta: float = 0.999) -> np.ndarray:
    """Weights (num_classes,) float32 for one head, scaled so that the mean weight of a training
    example is 1 (the loss keeps its scale whatever the rule).

    ``labels`` are the head's training labels (-1 = missing). "inverse": 1 / n_c; "effective":
    (1 - beta) / (1 - beta^n_c) (Cui et al., 2019: the expected number of distinct examples); a
    path: ``{head: [w_0, ...]}`` read from JSON as is. A class without training examples gets 1.
    """
    rule = str(rule)
    if rule not in RULES:
        return _from_file(rule, head, num_classes)
    if rule == "none":
        return np.ones(num_classes, np.float32)
    counts = np.bincount(labels[labels >= 0], minlength=num_classes)[:num_classes].astype(np.float64)
    seen = counts > 0
    w = np.ones(num_classes)
    if rule == "inverse":
        w[seen] = 1.0 / counts[seen]
    else:
        if not 0 <= beta < 1:
            raise ConfigError(f"config.task.effective_beta={beta}; use a value in [0, 1), e.g. 0.999.")
        w[seen] = (1.0 - beta) / (1.0 - beta ** counts[seen])
    mean_per_example = (w * counts).sum() / max(counts.sum(), 1)
    w[seen] /= mean_per_example
    return w.astype(np.float32)


def _from_file(path: str, head: str, num_classes: int) -> np.ndarray:
    if not os.path.isfile(os.path.expanduser(path)):
        raise ConfigError(f"config.task.class_weights={path!r} is neither one of {list(RULES)} nor a file; "
                          f"pick a rule or give a JSON file {{head: [w_0, w_1, ...]}}.")
    try:
        with open(os.path.expanduser(path)) as f:
            w = np.asarray(json.load(f)[head], np.float32)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"config.task.class_weights={path!r}: no weights for head {head!r} ({e!r}); "
                          f"give a JSON file {{head: [w_0, w_1, ...]}}.") from None
    if w.shape != (num_classes,) or not np.all(np.isfinite(w)) or np.any(w < 0):
        raise ConfigError(f"config.task.class_weights={path!r}: head {head!r} needs {num_classes} finite "
                          f"non-negative weights, got shape {w.shape}.")
    return w
