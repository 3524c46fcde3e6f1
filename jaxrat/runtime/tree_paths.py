"""One spelling of a pytree leaf's key path, shared by sharding rules, weight decay and checkpoints.

``("down", 0, "conv1", "kernel")`` is ``"down/0/conv1/kernel"`` whether a level is a dict, a list,
a dataclass or a namedtuple, so a regex written against a parameter name matches it in the params,
in every optimizer moment and in a checkpoint's metadata (where Orbax turns namedtuples into dicts).
"""

from __future__ import annotations

from typing import Any


def key_name(key: Any) -> str:
    """One key-path entry as text: a dict key, a sequence index or an attribute name."""
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def path_name(path: tuple) -> str:
    """A whole key path as ``"a/0/b"``."""
    return "/".join(key_name(k) for k in path)
