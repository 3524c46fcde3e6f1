"""What an async save takes from the train loop: a copy of the state and the data position, made on
the loop's thread; everything else (Orbax's per-array bookkeeping, the writes, the commit) runs on
one background thread.

Why not Orbax's own async save: it copies device arrays to host on the caller's thread one leaf at a
time, with per-leaf Python bookkeeping (replica slices, parameter infos, futures, thread starts)
that cost the ISIC RAT state (574 leaves, 55 MiB) 0.15-0.2 s of blocked loop where the copy itself
takes a few milliseconds. Here one compiled call copies every leaf (to pinned host memory where the
backend has it, so a big state does not hold device memory while it is written) and computes the
arrays' digests; the loop waits for that call only.

The copy is issued on the loop's thread, in program order with the training steps, so the digest's
collectives (a sharded leaf's sum) are ordered the same in every process; the background thread runs
no device collective. Orbax's barriers there go through the JAX distributed client (its
``experimental_orbax_use_distributed_barrier``), keyed by name, which is safe from a second thread.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import jax
import jax.numpy as jnp

from jaxrat.checkpointing import digest
from jaxrat.checkpointing.named_arrays import named_leaves


def use_distributed_barriers() -> None:
    """Make Orbax's barriers use the coordination service instead of a device collective.

    A collective from the save thread could interleave with the train step's in a different order on
    each process (a hang); the coordination service's named barriers cannot.
    """
    from absl import flags
    from orbax.checkpoint._src.multihost import multihost  # noqa: F401  (defines the flag)

    flags.FLAGS["experimental_orbax_use_distributed_barrier"].parse("true")


def _host_sharding(x: jax.Array) -> Any:
    sharding = x.sharding
    if jax.devices()[0].platform == "cpu":
        return sharding  # device memory is host memory: a plain copy is the host copy
    kinds = {m.kind for m in next(iter(sharding.device_set)).addressable_memories()}
    return sharding.with_memory_kind("pinned_host") if "pinned_host" in kinds else sharding


class Snapshotter:
    """Copies a state (one compiled call per state structure) and arranges its digests."""

    def __init__(self) -> None:
        self._compiled: dict[Any, Any] = {}
        self._names: dict[Any, list[str]] = {}

    def __call__(self, state: Any) -> tuple[Any, Any]:
        """(a copy of ``state`` that no later step can change, a callable returning its digests).

        Returns once the copy is complete. The digests are computed when the callable is called (on
        the save thread): from the host copy for arrays this process holds whole, on the devices,
        started here in program order, for arrays spread over processes (their sums are collectives).
        """
        leaves, treedef = jax.tree.flatten(state)
        arrays = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array)]
        names = self._names.get(treedef)
        if names is None:  # paths are slow to name (a few ms for 500 leaves): once per structure
            names = self._names[treedef] = [n for n, x in named_leaves(state).items() if isinstance(x, jax.Array)]
        spread = [k for k, i in enumerate(arrays) if not leaves[i].is_fully_addressable]
        on_device = digest.start_digests({names[k]: leaves[arrays[k]] for k in spread}) if spread else {}
        # One call per set of devices (a call's arrays must share them); usually there is one.
        groups: dict[Any, list[int]] = {}
        for i in arrays:
            groups.setdefault(frozenset(leaves[i].sharding.device_set), []).append(i)
        out = list(leaves)
        for members in groups.values():
            xs = [leaves[i] for i in members]
            for i, c in zip(members, self._compiled_for(xs)(xs)):
                out[i] = c
        jax.block_until_ready([out[i] for i in arrays])
        apart = set(spread)
        held = [(names[k], out[i]) for k, i in enumerate(arrays) if k not in apart]

        def digests() -> dict[str, int]:
            return {**{n: digest.host_digest(x) for n, x in held}, **digest.finish_digests(on_device)}

        return jax.tree.unflatten(treedef, out), digests

    def _compiled_for(self, xs: list[jax.Array]) -> Any:
        key = tuple((x.shape, x.dtype, x.sharding) for x in xs)
        if key not in self._compiled:
            def copy(arrays):
                return [jnp.copy(x) for x in arrays]

            host = [_host_sharding(x) for x in xs]
            try:
                self._compiled[key] = jax.jit(copy, out_shardings=host).lower(xs).compile()
            except Exception as e:  # a backend without host outputs for these arrays: copy on the devices
                if host == [x.sharding for x in xs]:
                    raise
                logging.warning("checkpoint: the state cannot be copied to pinned host memory (%s); the async "
                                "save copies it on the devices instead, which holds its size in device memory "
                                "while it is written", e)
                self._compiled[key] = jax.jit(copy, out_shardings=[x.sharding for x in xs]).lower(xs).compile()
        return self._compiled[key]


class FrozenDataState:
    """The data iterator's position at the save, for Grain's handler (which calls ``get_state``) on
    the save thread while the loop's iterator moves on."""

    def __init__(self, iterator: Any) -> None:
        import grain

        state = iterator.get_state()
        if isinstance(iterator, grain.DatasetIterator):  # Grain's handler JSON-encodes these itself
            state = json.dumps(state, indent=4).encode()
        self._state = state

    def get_state(self) -> Any:
        return self._state
