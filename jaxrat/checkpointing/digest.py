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

from jaxrat.checkpointing.named_arrays import named_leaves

_WORDS = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}


def leaf_digest(x: jax.Array) -> jax.Array:
    """The digest of one array, traced (see the module's docstring)."""
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


_digests = jax.jit(lambda tree: jax.tree.map(leaf_digest, tree))


def start_digests(arrays: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Dispatch the digests of ``arrays`` (every process, in the same order); read them with
    :func:`finish_digests`, from any thread."""
    return _digests(arrays)


def finish_digests(started: dict[str, jax.Array]) -> dict[str, int]:
    """The numbers of :func:`start_digests`' results."""
    # A scalar result is replicated, so this process's copy is the global value.
    return {name: int(np.asarray(v.addressable_data(0))) for name, v in started.items()}


def digest(state: Any) -> dict[str, int]:
    """``{"params/conv/kernel": 123456789, ...}``: one 32-bit digest per array leaf of ``state``.

    Every process must call it (a sharded leaf's sum is a collective); all get the same result.
    """
    return finish_digests(start_digests({n: x for n, x in named_leaves(state).items() if isinstance(x, jax.Array)}))


_HOST_WORDS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint32}
_CHUNK = 1 << 20


def host_digest(x: Any) -> int:
    """:func:`leaf_digest` of an array this process holds whole, computed with NumPy on the host
    (no device work, so any thread may call it); equal to the device's for every dtype."""
    if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    a = np.asarray(x)
    if a.dtype == np.bool_:
        a = a.view(np.uint8)
    # Row-major flat order of the words, as the device's per-dimension iotas number them (an 8-byte
    # element's two words are adjacent, low word first, as bitcast_convert_type splits it).
    words = np.ascontiguousarray(a).reshape(-1).view(_HOST_WORDS[a.dtype.itemsize])
    total = np.uint64(0)
    for start in range(0, words.size, _CHUNK):
        w = words[start:start + _CHUNK].astype(np.uint64)
        weights = (np.arange(start, start + w.size, dtype=np.uint64) * np.uint64(2) + np.uint64(1)) & np.uint64(
            0xFFFFFFFF)
        total += np.sum(w * weights, dtype=np.uint64)  # wraps modulo 2**64, a multiple of 2**32
    return int(total) & 0xFFFFFFFF


def mismatches(expected: dict[str, int], state: Any) -> list[str]:
    """Names of leaves of ``state`` whose digest differs from ``expected`` (leaves it lacks are skipped)."""
    got = digest(state)
    return sorted(n for n, v in expected.items() if n in got and got[n] != int(v))
