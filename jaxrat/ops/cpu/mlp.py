"""Cache-sized MLP chunks for CPUs (the ``cpu`` kernel policy).

From :data:`CHUNK_HIDDEN_BYTES` of hidden activation in one call the MLP runs over token chunks of
:data:`CHUNK_BYTES` that keep what the backward needs, so each chunk's GELU, dropout and their
gradients work in the cache; accelerators want the one wide product (docs/history/cpu.md, "CPU kernels").
"""

from __future__ import annotations

CHUNK_HIDDEN_BYTES = 16 * 2**20
CHUNK_BYTES = 8 * 2**20
