"""Nested settings as one level of dotted names: ``{"data": {"batch_size": 16}}`` -> ``{"data.batch_size": 16}``.

One spelling for every layer that compares, checks or logs configs (the config loader, the workdir's
resume check, the trackers' hyperparameters, the report's differences between runs).
"""

from __future__ import annotations

from typing import Any, Callable


def _nests(value: Any) -> bool:
    # A dict, an ml_collections ConfigDict (not a collections.abc.Mapping) or anything else with items().
    return hasattr(value, "items") and callable(value.items) and not isinstance(value, (str, bytes))


def flatten(tree: Any, prefix: str = "", leaf: Callable[[Any], Any] | None = None) -> dict[str, Any]:
    """Every leaf of ``tree`` (nested dicts or ConfigDicts) by its dotted name, ``prefix`` before
    each; ``leaf`` maps each leaf value (default: kept as it is)."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if _nests(v):
            out.update(flatten(v, f"{prefix}{k}.", leaf))
        else:
            out[f"{prefix}{k}"] = v if leaf is None else leaf(v)
    return out
