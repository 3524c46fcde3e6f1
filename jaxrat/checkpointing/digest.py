"""A fingerprint of a state's arrays, computed on the devices that hold them, to tell a checkpoint that
reads back different from what was saved.

OCDBT checksums its b-tree nodes and manifests but not the array bytes themselves: a flipped bit in a
stored array restores without an error. Each leaf's digest is ``sum(word_i * (2 i + 1)) mod 2**32``
over its raw bits, ``i`` the element's index in the global array: one fused pass over memory, the
same on any mesh and any number of processes (integer sums do not depend on order), and any single
flipped bit changes it (an odd multiple of a power of two below 2**32 is never 0 modulo 2**32).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrat.tree_paths import named_leaves

_WORDS = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}


def _leaf_digest(x: jax.Array) -> jax.Array:
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    words = jax.lax.bitcast_convert_type(x, _WORDS[x.dtype.itemsize]).astype(jnp.uint32)
    # The global element index, built from per-dimension iotas so a sharded leaf is never reshaped
    # (a reshape could move data between devices); overflow wraps and every weight stays odd.
    index = jnp.zeros(words.shape, jnp.uint32)
    stride = 1
    for dim in reversed(range(words.ndim)):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, words.shape, dim) * jnp.uint32(stride % 2**32)
        stride *= words.shape[dim]
    return jnp.sum(words * (index * jnp.uint32(2) + jnp.uint32(1)), dtype=jnp.uint32)


_digests = jax.jit(lambda tree: jax.tree.map(_leaf_digest, tree))


def digest(state: Any) -> dict[str, int]:
    """``{"params/conv/kernel": 123456789, ...}``: one 32-bit digest per array leaf of ``state``.

    Every process must call it (a sharded leaf's sum is a collective); all get the same result.
    """
    arrays = {name: leaf for name, leaf in named_leaves(state).items() if isinstance(leaf, jax.Array)}
    out = _digests(arrays)
    # A scalar result is replicated, so this process's copy is the global value.
    return {name: int(np.asarray(v.addressable_data(0))) for name, v in out.items()}


def mismatches(expected: dict[str, int], state: Any) -> list[str]:
    """Names of leaves of ``state`` whose digest differs from ``expected`` (leaves it lacks are skipped)."""
    got = digest(state)
    return sorted(n for n, v in expected.items() if n in got and got[n] != int(v))
