"""One spelling of a pytree leaf's key path, shared by sharding rules, weight decay and checkpoints.

``("down", 0, "conv1", "kernel")`` is ``"down/0/conv1/kernel"`` whether a level is a dict, a list,
a dataclass or a namedtuple, so a regex written against a parameter name matches it in the params,
in every optimizer moment and in a checkpoint's metadata (where Orbax turns namedtuples into dicts).
"""

from __future__ import annotations

from typing import Any, Iterable

import jax


def key_name(key: Any) -> str:
    """One key-path entry as text: a dict key, a sequence index or an attribute name."""
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def path_name(path: tuple) -> str:
    """A whole key path as ``"a/0/b"``."""
    return "/".join(key_name(k) for k in path)


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
