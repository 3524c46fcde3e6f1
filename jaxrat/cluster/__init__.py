"""The cluster a run belongs to: launcher detection, ``jax.distributed`` initialisation, preemption.

``detect`` is pure (config and environment in, :class:`ClusterSpec` out); ``initialize`` joins the
job, must run before any other JAX use, and starts the lost-peer watchdog (``peers``);
``preemption`` owns the stop signals and the requeue exit status; ``jobscript`` renders and submits
the SLURM/LSF job scripts (single runs and sweep job arrays; not imported here). Importing this
package does not import JAX.
"""

from jaxrat.cluster.detect import ClusterSpec, detect
from jaxrat.cluster.init import WorldInfo, initialize
from jaxrat.cluster.peers import stop_if_peer_lost
from jaxrat.cluster.preemption import (
    INTERRUPTED_EXIT_CODE,
    PREEMPTED_EXIT_CODE,
    Interrupted,
    Preempted,
    PreemptionWatch,
    preemption_requested,
)

__all__ = [
    "INTERRUPTED_EXIT_CODE",
    "PREEMPTED_EXIT_CODE",
    "ClusterSpec",
    "Interrupted",
    "Preempted",
    "PreemptionWatch",
    "WorldInfo",
    "detect",
    "initialize",
    "preemption_requested",
    "stop_if_peer_lost",
]
