"""Placeholder until the checkpointing package lands."""
from jaxrat.checkpoint import Checkpointer, Policy, SaveSchedule, load_init  # noqa: F401
