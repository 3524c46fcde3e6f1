"""Run a GPU custom kernel on each device's share of a sharded batch.

XLA cannot split a Pallas (Triton) custom call: under a sharded ``jit`` it would gather the
operands onto every device and run the whole batch there. Inside the trainer's step (traced under
``jax.set_mesh``) the batch is split over every mesh axis, so the call runs under ``shard_map`` on
each device's rows instead, with no communication.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
from jax.sharding import PartitionSpec as P

Array = jax.Array


def over_batch(fn: Callable[..., Any], *operands: Any, replicated: tuple = ()) -> Any:
    """``fn(*operands, *replicated)`` (operands and results arrays or pytrees of arrays), per device
    over the operands' leading (batch) axis when a mesh of several devices is set and that axis
    divides evenly, each device given the ``replicated`` arrays whole (weights; their gradients are
    summed over the devices); as it is otherwise (one device, no mesh, inside a ``shard_map``
    already, or a batch the mesh does not divide)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1 or mesh.manual_axes or jax.tree.leaves(operands)[0].shape[0] % mesh.size:
        return fn(*operands, *replicated)
    spec = P(tuple(mesh.axis_names))
    return jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * len(operands) + (P(),) * len(replicated), out_specs=spec,
                         check_vma=False)(*operands, *replicated)
