"""A tree of parameters as ``{name: array}`` and back: how checkpoints, their digests, weight files and
pretrained conversion name what they read and write (names spelt by :func:`jaxrat.runtime.tree_paths.path_name`).
"""

from __future__ import annotations

from typing import Any, Iterable

import jax

from jaxrat.runtime.tree_paths import path_name


def named_leaves(tree: Any) -> dict[str, Any]:
    """``{"params/Conv_0/kernel": leaf}`` for every array-like leaf of ``tree``."""
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, "shape"))[0]
    return {path_name(path): leaf for path, leaf in leaves}


def subtree(tree: Any, names: Iterable[str]) -> Any:
    """The nested dicts of ``tree`` holding only the leaves at ``names``, empty branches dropped (a
    partial restore's target; the part of a model that a weights file fills)."""
    keep = set(names)

    def walk(node: Any, prefix: str) -> Any:
        if hasattr(node, "shape"):
            return node if prefix in keep else None
        out = {}
        for k, v in node.items():
            sub = walk(v, f"{prefix}/{k}" if prefix else str(k))
            if sub is not None and sub != {}:
                out[k] = sub
        return out

    return walk(tree, "")
