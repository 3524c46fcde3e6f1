"""Placeholder until the cluster package lands."""
from jaxrat.checkpoint import PreemptionWatch  # noqa: F401
from jaxrat.distributed import initialize  # noqa: F401

PREEMPTED_EXIT_CODE = 42


class Preempted(Exception):
    pass
