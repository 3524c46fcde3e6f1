"""Run a GPU custom kernel on each device's share of a sharded batch.

XLA cannot split a Pallas (Triton) custom call: under a sharded ``jit`` it would gather the
operands onto every device and run the whole batch there. Inside the trainer's step (traced under
``jax.set_mesh``) the batch is split over every mesh axis, so the call runs under ``shard_map`` on
each device's rows instead, with no communication.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

Array = jax.Array


def splits() -> int:
    """Into how many parts :func:`over_batch` cuts a batch here (when the batch divides): the mesh's
    device count under a mesh of several devices, 1 without one or inside a ``shard_map``."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty or mesh.size == 1 or mesh.manual_axes else mesh.size


def copies(x: Array) -> Array:
    """``x`` with a new leading axis of :func:`splits` copies, the i-th on device i: what a per-device
    function (:func:`over_batch`) takes as a batch operand, so that the cotangents of its copies stay
    on their devices (a replicated operand's cotangent is summed over the devices at its full size)."""
    n = splits()
    y = jnp.broadcast_to(x[None], (n, *x.shape))
    if n == 1:
        return y
    return jax.lax.with_sharding_constraint(y, P(tuple(jax.sharding.get_abstract_mesh().axis_names)))


def over_batch(fn: Callable[..., Any], *operands: Any, replicated: tuple = (), first_row: bool = False) -> Any:
    """``fn(*operands, *replicated)`` (operands and results arrays or pytrees of arrays), per device
    over the operands' leading (batch) axis when a mesh of several devices is set and that axis
    divides evenly, each device given the ``replicated`` arrays whole (weights; their gradients are
    summed over the devices); as it is otherwise (one device, no mesh, inside a ``shard_map``
    already, or a batch the mesh does not divide).

    ``first_row``: ``fn`` takes first the index (int32) of its first batch row in the whole batch,
    0 when it runs on the whole batch (for randomness that must not depend on how the batch is cut).
    Inside a ``shard_map`` already that is 0 too: there the caller's operands are all it knows of."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1 or mesh.manual_axes or jax.tree.leaves(operands)[0].shape[0] % mesh.size:
        return fn(*([jnp.zeros((), jnp.int32)] if first_row else []), *operands, *replicated)
    axes = tuple(mesh.axis_names)
    spec = P(axes)
    if first_row:
        local = jax.tree.leaves(operands)[0].shape[0] // mesh.size
        body = lambda *args: fn(jax.lax.axis_index(axes).astype(jnp.int32) * local, *args)
    else:
        body = fn
    return jax.shard_map(body, mesh=mesh, in_specs=(spec,) * len(operands) + (P(),) * len(replicated), out_specs=spec,
                         check_vma=False)(*operands, *replicated)


def replicated(fn: Callable[..., Any], *operands: Any) -> Any:
    """``fn(*operands)`` on replicated operands and results, run by every device on its own copy when
    a mesh of several devices is set (a custom kernel is not split by XLA; without ``shard_map`` it
    would be run once and its results broadcast); as it is otherwise."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1 or mesh.manual_axes:
        return fn(*operands)
    return jax.shard_map(fn, mesh=mesh, in_specs=(P(),) * len(operands), out_specs=P(), check_vma=False)(*operands)
