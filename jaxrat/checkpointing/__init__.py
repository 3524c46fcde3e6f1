"""Checkpoints: the Orbax manager, when to save and what to keep, init_from, and folder facts.

The inspector CLI (``python -m jaxrat.checkpoints DIR``) lives in :mod:`jaxrat.checkpointing.inspect`
and is not imported here.
"""

from jaxrat.checkpointing.init_from import load_init
from jaxrat.checkpointing.manager import Checkpointer
from jaxrat.checkpointing.schedule import Policy, SaveSchedule

__all__ = ["Checkpointer", "Policy", "SaveSchedule", "load_init"]
