"""Checkpoints: the Orbax manager, when to save and what to keep, init_from, and folder facts.

The inspector CLI (``python -m jaxrat.checkpoints DIR``) lives in :mod:`jaxrat.checkpointing.inspect`
and is not imported here. The names below are imported on first use (PEP 562), so that reading a
checkpoint folder with :mod:`jaxrat.checkpointing.store` (e.g. ``python -m jaxrat.sweep`` on a login
node) does not load Orbax and JAX.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jaxrat.checkpointing.init_from import load_init
    from jaxrat.checkpointing.manager import Checkpointer
    from jaxrat.checkpointing.schedule import Policy, SaveSchedule

_WHERE = {"Checkpointer": "manager", "Policy": "schedule", "SaveSchedule": "schedule", "load_init": "init_from"}
__all__ = ["Checkpointer", "Policy", "SaveSchedule", "load_init"]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"jaxrat.checkpointing.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'jaxrat.checkpointing' has no attribute {name!r}")
